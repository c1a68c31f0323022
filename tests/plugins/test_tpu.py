"""paged-tpu without torch_xla: probe reasons, selection, buckets and padding, the static
pure-torch attention against the cpu backend, and the whole XLA step runner end to end
on a stand-in torch_xla that runs eagerly on the CPU. ci/xla.sh runs the real thing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if find_spec("paged_tpu") is None:  # not installed: test it from the tree
    sys.path.insert(0, str(ROOT / "plugins" / "tpu"))

import paged_tpu.attention as ta  # noqa: E402
import paged_tpu.hooks  # noqa: E402
import paged_tpu.platform as tp  # noqa: E402
from paged.config import EngineConfig  # noqa: E402
from paged.model.attention import AttentionMetadata  # noqa: E402
from paged.plugins import NoPlatformError, get_plugin_manager, select_platform  # noqa: E402
from paged_cpu.attention import CpuAttentionBackend  # noqa: E402
from paged_tpu.buckets import (  # noqa: E402
    PAD_SLOT,
    Buckets,
    Layout,
    dummy_step,
    pack_step,
    pad_to,
    pow2_buckets,
)
from paged_tpu.platform import TpuPlatform  # noqa: E402


@pytest.fixture
def tpu_registered(monkeypatch):
    """The plugin's hooks registered as its entry point would; torch_xla looks absent."""
    monkeypatch.delenv("PAGED_PLATFORM", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv(ta.ATTENTION_ENV, raising=False)
    pm = get_plugin_manager()
    added = not pm.is_registered(paged_tpu.hooks)
    if added:
        pm.register(paged_tpu.hooks)
    yield
    if added:
        pm.unregister(paged_tpu.hooks)


def test_probe_reasons(monkeypatch, tpu_registered):
    if find_spec("torch_xla") is None:
        assert TpuPlatform.probe().startswith("torch_xla not installed")
    assert tp.xla_mismatch("2.9.0", "2.13.0+cpu") == (
        "torch_xla 2.9.0 needs torch 2.9.* (this is torch 2.13.0+cpu)"
    )
    assert tp.xla_mismatch("2.9.0", "2.9.1+cu128") is None
    assert tp.xla_mismatch("", "2.13.0") is None  # a source build: trusted
    monkeypatch.setattr(tp, "torch_xla_version", lambda: "")
    monkeypatch.setattr(tp, "tpu_chips", lambda *a: 0)
    assert "no XLA device" in TpuPlatform.probe()
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert TpuPlatform.probe() is None  # XLA:CPU, asked for
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert "no TPU chip" in TpuPlatform.probe()
    monkeypatch.setattr(tp, "tpu_chips", lambda *a: 4)
    assert TpuPlatform.probe() is None


def test_tpu_chips_reads_pci_ids(tmp_path):
    for name, vendor, device in [
        ("0000:00:04.0", "0x1ae0", "0x0063"),  # TPU v5e
        ("0000:00:05.0", "0x1ae0", "0x0042"),  # gVNIC: Google, not a TPU
        ("0000:00:06.0", "0x10de", "0x2330"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    assert tp.tpu_chips(str(tmp_path)) == 1


def test_selection(monkeypatch, tpu_registered):
    monkeypatch.setattr(TpuPlatform, "probe", classmethod(lambda cls: "torch_xla not installed"))
    assert select_platform().name != "tpu"
    with pytest.raises(NoPlatformError, match="'tpu' is not available: torch_xla not installed"):
        select_platform("tpu")
    monkeypatch.setattr(TpuPlatform, "probe", classmethod(lambda cls: None))
    chosen = select_platform()
    assert chosen.name == "tpu" and chosen.dist_backend == "xla"
    assert chosen.device == torch.device("cpu")  # the runner's host side


def test_import_and_probe_never_import_torch_xla(tmp_path):
    """With a torch_xla that explodes on import, listing and probing still work."""
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("raise ImportError('imported!')\n")
    code = f"""
    import sys
    sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT / "plugins" / "tpu")!r}]
    import paged_tpu, paged_tpu.hooks, paged_tpu.buckets, paged_tpu.attention
    from paged_tpu.platform import TpuPlatform
    print(TpuPlatform.probe(), "torch_xla" in sys.modules)
    """
    env = {"PATH": "/usr/bin:/bin", "PJRT_DEVICE": "CPU"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False"


def test_buckets():
    assert pow2_buckets(16, 100) == [16, 32, 64, 100]
    assert pow2_buckets(16, 64) == [16, 32, 64]
    assert pow2_buckets(8, 5) == [5]
    assert [pad_to(n, [16, 32, 100]) for n in (1, 16, 17, 100)] == [16, 16, 32, 100]
    with pytest.raises(ValueError, match="exceeds"):
        pad_to(101, [16, 32, 100])
    cfg = EngineConfig(max_model_len=1000, max_num_batched_tokens=2048, max_num_seqs=256)
    b = Buckets.from_config(cfg)
    assert b.tokens == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert b.reqs == [8, 16, 32, 64, 128, 256]
    assert (b.max_reqs, b.max_blocks, b.count) == (256, 63, 14)


def test_pack_step_pads_to_the_layout():
    layout = Layout(tokens=16, reqs=4, blocks=3)
    qsl = np.array([0, 1, 4])  # a decode, then a 3-token chunk
    buf = pack_step(
        layout,
        np.array([7, 8, 9, 10]),
        np.array([5, 0, 1, 2]),
        np.array([37, 16, 17, 18]),
        qsl,
        np.array([6, 3]),
        np.array([[0, 2], [1, 0]]),
    )
    assert buf.dtype == np.int32 and len(buf) == layout.size
    f = {name: buf[lo:hi].tolist() for name, (lo, hi) in layout.fields().items()}
    assert f["input_ids"] == [7, 8, 9, 10] + [0] * 12
    assert f["slots"] == [37, 16, 17, 18] + [PAD_SLOT] * 12
    assert f["req_idx"] == [0, 1, 1, 1] + [0] * 12
    assert f["query_start_loc"] == [0, 1, 4, 4, 4]
    assert f["seq_lens"] == [6, 3, 0, 0]
    assert f["last_rows"] == [0, 3, 0, 0]
    assert f["num_seqs"] == [2]
    assert f["block_tables"] == [0, 2, 0, 1, 0, 0] + [0] * 6
    empty = dummy_step(layout)
    assert empty[layout.fields()["num_seqs"][0]] == 0
    with pytest.raises(ValueError, match="exceeds"):
        pack_step(layout, *([np.zeros(17, np.int64)] * 3), qsl, np.array([6, 3]), np.zeros((2, 2)))


def test_kernel_layout_and_choice(monkeypatch, tpu_registered):
    """--tpu-attention through the platform; PAGED_TPU_ATTENTION only without it."""
    args = (4, 2, 64, 0.125, 16, torch.bfloat16, torch.device("cpu"))
    platform = TpuPlatform()
    monkeypatch.setenv(ta.ATTENTION_ENV, "pallas")  # the fallback, no flag given
    backend = platform.attention_backend()(*args)
    assert backend.use_kernel and backend.kv_cache_shape(10) == (10, 16, 4, 128)
    platform.configure({"tpu_attention": "torch"})  # the flag wins over the environment
    backend = platform.attention_backend()(*args)
    assert not backend.use_kernel and backend.kv_cache_shape(10) == (10, 16, 4, 64)
    assert ta.TpuAttentionBackend(*args, attention="pallas").use_kernel
    with pytest.raises(ValueError, match="auto, pallas or torch"):
        ta.use_pallas_kernel("cuda")
    monkeypatch.setenv(ta.ATTENTION_ENV, "cuda")
    with pytest.raises(ValueError, match="PAGED_TPU_ATTENTION='cuda': use auto, pallas, torch"):
        TpuPlatform().configure({})


def test_static_torch_attention_matches_cpu_backend(monkeypatch):
    """A mixed step (decodes, a chunk over cached context, a fresh prompt) padded to a
    bucket: real rows equal the cpu backend's, padding writes nowhere."""
    bs, h, hkv, d = 16, 4, 2, 32
    args = (h, hkv, d, d**-0.5, bs, torch.float32, torch.device("cpu"))
    tpu, cpu = ta.TpuAttentionBackend(*args, attention="torch"), CpuAttentionBackend(*args)
    reqs = [(40, 1), (3, 1), (20, 9), (0, 12)]  # (cached context, new tokens), decodes first
    gen = torch.Generator().manual_seed(0)
    nblocks = [-(-(c + n) // bs) for c, n in reqs]
    ids = torch.randperm(sum(nblocks) + 3, generator=gen)[: sum(nblocks)]
    tables = torch.zeros(len(reqs), max(nblocks), dtype=torch.int32)
    ctx_k = torch.randn(sum(nblocks) + 3, bs, hkv, d, generator=gen)
    ctx_v = torch.randn(sum(nblocks) + 3, bs, hkv, d, generator=gen)
    slots, pos, off = [], [], 0
    for i, ((c, n), nb) in enumerate(zip(reqs, nblocks)):
        tables[i, :nb] = ids[off : off + nb]
        off += nb
        pos += list(range(c, c + n))
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
    t = len(slots)
    q, k, v = (torch.randn(t, hh, d, generator=gen) for hh in (h, hkv, hkv))
    qsl = np.cumsum([0] + [n for _, n in reqs])
    seqs = np.array([c + n for c, n in reqs])
    cpu_cache = torch.stack((ctx_k, ctx_v)).permute(0, 3, 1, 2, 4).contiguous()  # head-major
    meta = AttentionMetadata(
        len(reqs), 2, t, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seqs).int(),
        tables, torch.tensor(slots), 12, int(seqs.max()),
        [n for _, n in reqs], seqs.tolist(),
    )  # fmt: skip
    want = cpu.forward(q, k, v, cpu_cache, cpu.plan(meta))
    cpu_cache = cpu_cache.permute(0, 2, 3, 1, 4)  # back to [2, blocks, block, heads, d]

    layout = Layout(tokens=32, reqs=8, blocks=6)
    buf = pack_step(layout, np.zeros(t), np.array(pos), np.array(slots), qsl, seqs, tables.numpy())
    _, _, pmeta, _ = ta.unpack(torch.from_numpy(buf), layout, bs)
    tpu_cache = torch.stack((ctx_k, ctx_v), dim=3).flatten(2, 3).contiguous()  # interleaved
    pad = lambda x: torch.cat((x, torch.zeros(layout.tokens - t, *x.shape[1:])))
    got = tpu.forward(pad(q), pad(k), pad(v), tpu_cache, tpu.plan(pmeta))
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    kv = tpu_cache.view(-1, bs, hkv, 2, d)
    torch.testing.assert_close(kv[..., 0, :], cpu_cache[0])  # same writes, no stray ones
    torch.testing.assert_close(kv[..., 1, :], cpu_cache[1])


def test_step_runner_end_to_end_on_a_stand_in_xla(monkeypatch, tpu_registered, tiny_models):
    """XlaStepRunner (padding, buckets, device model, KV move, greedy tail, host rows) with
    a torch_xla whose device is the CPU: greedy tokens equal the cpu plugin's."""
    from paged import LLM, SamplingParams

    stub = types.ModuleType("torch_xla")
    stub.device = lambda index=None: torch.device("cpu")
    stub.sync = lambda wait=False, reset_scope=True: None
    monkeypatch.setitem(sys.modules, "torch_xla", stub)
    monkeypatch.setattr(TpuPlatform, "probe", classmethod(lambda cls: None))
    monkeypatch.setenv(ta.ATTENTION_ENV, "torch")
    cfg = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n in (3, 45, 17, 8, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name in ("cpu", "tpu"):
        llm = LLM(tiny_models["llama"], platform=name, num_kv_blocks=64, **cfg)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
        llm.engine.kv.check_invariants()
    step = llm.engine.runner.step_runner
    assert step.buckets.tokens == [16, 32] and step.buckets.reqs == [4]
    assert outs["tpu"] == outs["cpu"]
    assert step.last_greedy  # the tail ran
    assert all(p.numel() == 0 for p in llm.engine.runner.model.layers.parameters())
