"""paged chat / complete --quick against a live server."""

from __future__ import annotations


def test_chat_quick(cli, server_url):
    rc, out, err = cli(
        "chat", "--url", server_url, "--quick", "hello", "--max-tokens", "8", "--temperature", "0"
    )
    assert rc == 0, err
    assert out.endswith("\n") and len(out) > 1  # a streamed reply, then a newline


def test_chat_with_system_and_model(cli, server_url):
    rc, out, err = cli(
        "chat",
        "--url",
        server_url,
        "--model",
        "tiny",
        "--system",
        "be brief",
        "--quick",
        "hi",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
    )
    assert rc == 0, err


def test_complete_quick(cli, server_url):
    rc, out, err = cli("complete", "--url", server_url, "--quick", "the quick", "--max-tokens", "4")
    assert rc == 0, err
    assert out.endswith("\n")


def test_chat_unreachable_server(cli):
    rc, _, err = cli("chat", "--url", "http://127.0.0.1:9/v1", "--quick", "hi")
    assert rc == 1 and "cannot reach" in err


def test_client_errors_name_the_cause(cli, server_url):
    """The server was reached: a URL without /v1 gets a hint, not 'cannot reach'."""
    root = server_url.removesuffix("/v1")
    rc, _, err = cli("chat", "--url", root, "--quick", "hi")
    assert rc == 1 and err.count("\n") == 1 and "cannot reach" not in err
    assert err.startswith(f"error: {root} answered 404 (") and "is the URL missing /v1?" in err
    rc, _, err = cli("complete", "--url", server_url, "--model", "nosuch", "--quick", "hi")
    assert rc == 1 and err.startswith("error: the server answered 404: ") and "nosuch" in err
