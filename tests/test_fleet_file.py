"""Fleet files (paged.engine.fleet): valid ones parse into per-replica configs; invalid ones
fail naming the file, line and field. No engine is started."""

from __future__ import annotations

import pytest

from paged.config import EngineConfig
from paged.engine.fleet import (
    FleetError,
    check_groups,
    check_platforms,
    check_size,
    group_configs,
    load_fleet,
    parse_fleet,
)

GOOD = """\
model: /models/tiny
args: {dtype: float32, kv-cache-memory: 16MiB}
replicas:
  - platform: cpu
    count: 2
    args: {max_num_seqs: 32, enable_prefix_caching: false}
  - {platform: example}       # a plugin's platform
"""


def test_a_valid_file_gives_one_config_per_replica():
    fleet = parse_fleet(GOOD)
    assert fleet.size == 3 and fleet.model == "/models/tiny"
    base = EngineConfig(max_model_len=512, max_num_seqs=8)
    cfgs = group_configs(fleet, base)
    assert [c.platform for c in cfgs] == ["cpu", "cpu", "example"]
    assert [c.max_num_seqs for c in cfgs] == [32, 32, 8]  # the group's, else the command line's
    assert {c.dtype for c in cfgs} == {"float32"} and cfgs[0].kv_cache_memory == 16 << 20
    assert not cfgs[0].enable_prefix_caching and cfgs[2].enable_prefix_caching
    assert all(c.model == "/models/tiny" and c.max_model_len == 512 for c in cfgs)
    assert all(c.data_parallel_size == 1 for c in cfgs)


def test_json_is_accepted():
    fleet = parse_fleet('{"replicas": [{"platform": "cpu", "count": 2}]}')
    assert fleet.model is None and fleet.size == 2


@pytest.mark.parametrize(
    "text, where",
    [
        # an unknown engine argument: its line, named, with the known ones listed
        (GOOD.replace("max_num_seqs: 32", "max_num_sequences: 32"),
         ["<fleet>:6:", "replicas[0].args.max_num_sequences", "unknown engine argument",
          "max_num_seqs"]),
        # a count that is not a positive integer
        (GOOD.replace("count: 2", "count: 0"), ["<fleet>:5:", "replicas[0].count", "greater"]),
        (GOOD.replace("count: 2", "count: two"), ["<fleet>:5:", "replicas[0].count"]),
        # a group without a platform: the group's line
        (GOOD.replace("{platform: example}", "{count: 1}"),
         ["<fleet>:7:", "replicas[1].platform", "required"]),
        # an unknown field in a group, and at the top
        (GOOD.replace("count: 2", "cont: 2"), ["<fleet>:5:", "replicas[0].cont", "unknown field"]),
        (GOOD + "routr: prefix\n", ["<fleet>:8:", "routr", "unknown field"]),
        # a value of the wrong type for its flag
        (GOOD.replace("max_num_seqs: 32", "max_num_seqs: lots"),
         ["<fleet>:6:", "replicas[0].args.max_num_seqs", "invalid value 'lots'"]),
        (GOOD.replace("enable_prefix_caching: false", "enable_prefix_caching: 3"),
         ["<fleet>:6:", "enable_prefix_caching", "true or false"]),
        # what the file says itself does not belong in args
        (GOOD.replace("max_num_seqs: 32", "platform: cuda"),
         ["<fleet>:6:", "replicas[0].args.platform", "not in args"]),
        # no replicas; not a mapping; not YAML
        ("model: x\nreplicas: []\n", ["<fleet>:2:", "replicas", "at least 1"]),
        ("- 1\n- 2\n", ["<fleet>:1:", "expected a mapping"]),
        ("replicas: [\n  {platform: cpu\n", ["<fleet>:", "not valid YAML"]),
        # a count (or num_cpus) that is a boolean, not a number
        (GOOD.replace("count: 2", "count: true"), ["<fleet>:5:", "replicas[0].count", "integer"]),
        (GOOD.replace("count: 2", "num_cpus: yes"), ["<fleet>:5:", "replicas[0].num_cpus"]),
        # a key said twice, in any mapping: the second one's line
        (GOOD + "replicas:\n  - {platform: cpu}\n", ["<fleet>:8:", "replicas", "duplicate key"]),
        (GOOD.replace("count: 2", "count: 2\n    count: 3"),
         ["<fleet>:6:", "replicas[0].count", "duplicate key 'count'"]),
        (GOOD.replace("max_num_seqs: 32", "max_num_seqs: 32, max_num_seqs: 4"),
         ["<fleet>:6:", "replicas[0].args.max_num_seqs", "duplicate key"]),
    ],
)  # fmt: skip
def test_invalid_files_name_the_line_and_field(text, where):
    with pytest.raises(FleetError) as e:
        parse_fleet(text)
    for part in where:
        assert part in str(e.value), (part, str(e.value))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_bytes(b"replicas:\n  - {platform: cpu}  # caf\xe9\n")
    with pytest.raises(FleetError, match=r"b.yaml: not UTF-8 text"):
        load_fleet(f)


def test_unknown_platforms_are_refused_naming_the_installed_ones():
    check_platforms(parse_fleet("replicas:\n  - {platform: cpu}\n"))
    fleet = parse_fleet("replicas:\n  - {platform: cpu}\n  - platform: cpuu\n    count: 2\n")
    with pytest.raises(FleetError) as e:
        check_platforms(fleet)
    msg = str(e.value)
    assert msg.startswith("<fleet>:3: replicas[1].platform: unknown platform 'cpuu'"), msg
    assert "(installed: " in msg and "cpu" in msg


def _model(tmp_path) -> str:
    """A model directory with only a config.json (read with load_format dummy)."""
    import json

    d = tmp_path / "model"
    d.mkdir()
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_group_args_are_checked_against_the_models_config(tmp_path):
    from paged.server.serving_stack import check_model

    text = (f"model: {_model(tmp_path)}\nargs: {{load_format: dummy}}\nreplicas:\n"
            "  - {platform: cpu, args: {max_model_len: 256}}\n"
            "  - platform: cpu\n    args:\n      max_model_len: 999999\n")  # fmt: skip
    fleet = parse_fleet(text, "f.yaml")
    configs = group_configs(fleet, EngineConfig(), "f.yaml")
    with pytest.raises(FleetError) as e:
        check_groups(fleet, configs, check_model)
    msg = str(e.value)
    assert msg.startswith("f.yaml:7: replicas[1] (cpu): max_model_len: 999999 is greater"), msg
    check_groups(parse_fleet(text.split("  - platform")[0]), configs[:1], check_model)


def test_a_fleet_larger_than_the_host_is_refused(monkeypatch):
    import paged.engine.placement as placement

    monkeypatch.setattr(placement, "usable_cpus", lambda: [0, 1])
    per_host = placement.REPLICAS_PER_CORE * 2
    text = f"replicas:\n  - {{platform: cpu, count: {per_host}}}\n"
    fleet = parse_fleet(text)
    check_size(fleet, group_configs(fleet, EngineConfig()))  # oversubscribed, unpinned: runs
    fleet = parse_fleet(text + "  - platform: cpu\n    count: 100000\n")
    with pytest.raises(FleetError) as e:
        check_size(fleet, group_configs(fleet, EngineConfig()))
    msg = str(e.value)
    assert msg.startswith("<fleet>:4: replicas[1].count: ") and "more than it can run" in msg
    # a device platform: no more replicas x ranks than the devices it shows
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    fleet = parse_fleet(
        "replicas:\n  - {platform: cuda, count: 2, args: {tensor_parallel_size: 2}}\n"
    )
    with pytest.raises(
        FleetError, match=r"replicas\[0\].count: 4 cuda devices needed .* 3 visible"
    ):
        check_size(fleet, group_configs(fleet, EngineConfig()))


def test_engine_checks_name_the_group(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text("replicas:\n  - {platform: cpu, args: {block_size: 12}}\n")
    fleet = load_fleet(f)
    with pytest.raises(FleetError, match=r"fleet.yaml: replicas\[0\] \(cpu\): block_size"):
        group_configs(fleet, EngineConfig(), str(f))
    with pytest.raises(FleetError, match="cannot read the fleet file"):
        load_fleet(tmp_path / "missing.yaml")


def test_serve_refuses_an_invalid_fleet_file_before_starting(tmp_path, caplog):
    from paged.cli.main import main

    f = tmp_path / "fleet.yaml"
    f.write_text("replicas:\n  - platform: cpu\n    count: 1\n    args: {max_num_sequences: 2}\n")
    assert main(["serve", "--fleet", str(f)]) == 2
    assert f"{f}:4: replicas[0].args.max_num_sequences: unknown engine argument" in caplog.text


@pytest.mark.parametrize(
    "text, message",
    [
        ("replicas:\n  - {platform: cpuu}\n", ":2: replicas[0].platform: unknown platform 'cpuu'"),
        (b"replicas: [{platform: cpu}] # \xff\n", "fleet.yaml: not UTF-8 text"),
        ("replicas:\n  - {platform: cpu, count: 100000}\n", "replicas[0].count: 100000 replicas"),
        ("replicas: [{platform: cpu}]\nreplicas: [{platform: cpu}]\n", "duplicate key"),
    ],
)
def test_serve_refuses_what_cannot_run_before_starting(tmp_path, caplog, text, message):
    from paged.cli.main import main

    f = tmp_path / "fleet.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["serve", "--fleet", str(f)]) == 2
    assert "invalid fleet file: " in caplog.text and message in caplog.text, caplog.text


def test_serve_refuses_a_group_above_the_models_context_before_starting(tmp_path, caplog):
    from paged.cli.main import main

    f = tmp_path / "fleet.yaml"
    f.write_text(f"model: {_model(tmp_path)}\nargs: {{load_format: dummy}}\n"
                 "replicas: [{platform: cpu, args: {max_model_len: 999999}}]\n")  # fmt: skip
    assert main(["serve", "--fleet", str(f)]) == 2
    assert f"invalid fleet file: {f}:3: replicas[0] (cpu): max_model_len: 999999" in caplog.text


def test_serve_refuses_a_data_parallel_size_the_host_cannot_run(caplog):
    from paged.cli.main import main

    assert main(["serve", "--data-parallel-size", "100000"]) == 2
    assert "invalid configuration: data_parallel_size: 100000 replicas" in caplog.text
