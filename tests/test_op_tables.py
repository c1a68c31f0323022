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


class PrefetchingCpu(CpuPlatform):
    """The CPU platform's ops with a prefetch_weight that records what it is asked for."""

    name = "prefetching-cpu"
    asked: list[tuple[int, int]] = []  # (the weight's data pointer, rows)

    def ops(self):
        def prefetch(weight, rows):
            self.asked.append((weight.data_ptr(), rows))

        return {**super().ops(), "prefetch_weight": prefetch}


def test_attention_hints_o_proj_weight_before_the_attention(tiny_models, engines_on):
    """Each layer asks the platform to prefetch its o_proj weight, with the step's row count
    (the CUDA plugin's --cuda-l2-prefetch), and the output does not change."""
    path, prompt = tiny_models["llama"], list(range(5, 40))
    want = LLM(path, dtype="float32", kv_cache_memory="16MiB").generate(
        prompt, PARAMS, use_tqdm=False
    )[0].outputs[0].token_ids
    engines_on(PrefetchingCpu())
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    PrefetchingCpu.asked.clear()
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want
    model = llm.engine.runner.model
    o_projs = [m.o_proj.weight.data_ptr() for m in model.modules() if hasattr(m, "o_proj")]
    steps = len(PrefetchingCpu.asked) // len(o_projs)
    assert steps == PARAMS.max_tokens  # the prompt's step, then a decode per later token
    assert PrefetchingCpu.asked[: len(o_projs)] == [(p, len(prompt)) for p in o_projs]
    assert PrefetchingCpu.asked[-len(o_projs) :] == [(p, 1) for p in o_projs]
