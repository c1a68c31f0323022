"""Start-up warm-up: synthetic requests through the engine's own step loop, so that the kernel
variants a server meets are compiled before the first client's request rather than during it
(a Triton kernel compiles on first use, for each new set of tile sizes and argument
specialisations: up to a second each, which lands in p99 time to first token).

The requests cover what steps vary in: prefill chunks from one token to the whole budget,
a prompt longer than one chunk (its second chunk attends to cached context), steps that mix
decodes with prefills, decode batch sizes, and the sampling paths (greedy, top-k/top-p/min-p
with a seed, penalties, logprobs), plus a repetitive prompt for n-gram speculation, and with
LoRA adapters given at start-up (--lora-modules) steps mixing adapter and base rows. Afterwards
the prefix cache and the counters are as they were: clients see a fresh engine.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams

if TYPE_CHECKING:
    from paged.engine.core import EngineCore

log = logging.getLogger("paged")

# Prompt lengths (capped by the context): prefill tiles are sized from a step's longest query.
SHORT_LENGTHS = (1, 3, 8, 16, 17, 64, 127, 500)
MAX_STEPS = 10_000  # a bound, never reached by these requests
WARMUP_LORA_ID = 2**31 - 1  # the warm-up's adapter id, forgotten before any client's


def sampling_variants(max_tokens: int) -> list[SamplingParams]:
    """The sampling paths a step can take."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return [
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1, **common),
        SamplingParams(temperature=1.0, min_p=0.05, seed=2, logprobs=2, **common),
        SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2, **common),
    ]


def warmup_prompts(budget: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids: the short lengths, one prompt of one and a half chunks (a continuation chunk
    over cached context), and a repetitive one (n-gram speculation proposes from it)."""
    rng = random.Random(seed)
    limit = max(1, context - 8)  # room for the output
    lengths = sorted({min(n, limit) for n in SHORT_LENGTHS})
    lengths.append(min(limit, budget + budget // 2 + 3))
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    pattern = [rng.randrange(vocab) for _ in range(8)]
    prompts.append((pattern * (1 + min(limit, 64) // 8))[: min(limit, 64)])
    return prompts


def warmup_lora(engine: EngineCore) -> LoRARequest | None:
    """With --enable-lora and --lora-modules, the first module under an id of the warm-up's
    own, so that steps mixing adapter and base rows run the LoRA kernels; else None."""
    modules = engine.config.lora_modules or []
    if engine.runner.lora is None or not modules:
        return None
    lora = LoRARequest("warmup", WARMUP_LORA_ID, modules[0]["path"])
    try:
        engine.runner.lora.check(lora)
    except (ValueError, OSError) as e:  # the server reports a bad module itself
        log.warning("warm-up without LoRA: %s", e)
        return None
    return lora


def warm_up(engine: EngineCore) -> float:
    """Run the warm-up requests to the end; the seconds it took. The engine must be idle."""
    t0 = time.perf_counter()
    cfg = engine.config
    prompts = warmup_prompts(cfg.max_num_batched_tokens, engine.max_model_len, engine.vocab_size)
    variants = sampling_variants(max_tokens=16)
    lora = warmup_lora(engine)
    # One new prompt a step, beside the earlier ones' decodes: each tile size that the prefill
    # kernels pick from a step's longest query, in steps that mix decodes and prefills.
    outs = []
    for n, ids in enumerate(prompts):  # with LoRA, every other request runs the adapter
        adapter = lora if n % 2 else None
        engine.add_request(f"warmup-{n}", ids, variants[n % len(variants)], adapter)
        outs += engine.step()
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        outs += engine.step()
    else:
        raise RuntimeError("warm-up: requests did not finish")
    failed = [o for o in outs if o.error]
    if failed:  # a step failed on synthetic input: a bug that clients would meet too
        raise RuntimeError(f"warm-up: request {failed[0].request_id} failed: {failed[0].error}")
    if lora is not None:  # forgotten: its id is never a client's
        engine.remove_lora(lora.lora_int_id)
        engine.runner.lora.loads = 0
    engine.kv.reset_prefix_cache()
    engine.reset_counters()
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d synthetic requests in %.1f s", len(prompts), seconds)
    return seconds
