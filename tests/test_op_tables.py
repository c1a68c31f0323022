"""Each model runner runs its own platform's ops (paged.model.ops is one table per process):
an engine built later does not swap the kernels of one built before it."""

from __future__ import annotations

from paged import LLM, SamplingParams
from paged.model import ops
from paged_cpu.platform import CpuPlatform

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class CountingCpu(CpuPlatform):
    """The CPU platform's ops, each call of every op counted."""

    name = "counting-cpu"
    calls: list[str] = []

    def ops(self):
        table = ops.table(super().ops())

        def counted(name, fn):
            return lambda *a, **kw: self.calls.append(name) or fn(*a, **kw)

        return {name: counted(name, fn) for name, fn in table.items()}


def test_two_engines_in_one_process_each_run_their_own_ops(tiny_models, engines_on):
    path, prompt = tiny_models["llama"], list(range(5, 40))
    plain = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    want = plain.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    counting_platform = CountingCpu()
    engines_on(counting_platform)
    counting = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    assert counting.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want
    assert CountingCpu.calls  # the second engine ran its table
    CountingCpu.calls.clear()
    assert plain.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want
    assert CountingCpu.calls == []  # the first engine, its own (before: the counting ops)
    assert counting.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want
    assert CountingCpu.calls
