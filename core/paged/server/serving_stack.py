"""The serving stack without HTTP: the model's name and tokenizer, the chat template, the
generation defaults, LoRA adapters, the engine (one, data-parallel replicas or a fleet) and
the `Serving` object over them. `paged serve` puts metrics and uvicorn in front of it;
`paged run-batch` sends a batch file's lines through the same app in process."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from paged.config import EngineConfig
from paged.server.serving import Serving

log = logging.getLogger("paged.server")


class StartError(Exception):
    """Why the stack cannot start: the message, as the log says it."""


def tokenizer_loader(config: EngineConfig) -> tuple[str, Any, str | None]:
    """(model name, a function loading the tokenizer or None, the model's path or None)
    without loading weights."""
    from paged.model.shapes import SHAPES

    if config.load_format == "dummy" and config.model and config.model.lower() in SHAPES:
        return config.model, None, None  # a named shape: token ids only
    from paged.model.loader import load_tokenizer, resolve_model

    src = resolve_model(config.model, config.load_format, config.revision, config.download_dir)
    return src.name, lambda: load_tokenizer(src, config.tokenizer), src.path


def _read_config(model: EngineConfig) -> Any:
    """config.json of `model` (a config whose model is the one to read); None where the model
    cannot be found (build_serving says so); ValueError where it cannot be read."""
    from paged.model.shapes import SHAPES, shape_config

    if model.load_format == "dummy" and model.model and model.model.lower() in SHAPES:
        return shape_config(model.model)
    from paged.model.loader import load_config, resolve_model

    try:
        src = resolve_model(model.model, model.load_format, model.revision, model.download_dir)
    except (ValueError, OSError):
        return None
    return load_config(src)


def check_model(config: EngineConfig) -> None:
    """What config.json (the model's, a draft's) tells before the engine starts: a ValueError
    naming the field for an architecture paged lacks, a max_model_len above the model's, a
    tensor / pipeline parallel size the model cannot be split by (its heads, its layers), a
    MoE routing more experts than it has, an embedding model over pipeline stages, a
    --quantization the checkpoint cannot take, a draft that cannot be read or does not fit."""
    from paged.config import check_max_model_len
    from paged.model.parallel import check_split
    from paged.model.registry import model_class
    from paged.quantization.select import quant_method

    try:
        hf = _read_config(config)
        if hf is not None:
            model_class(hf)
    except (ValueError, OSError) as e:
        raise ValueError(f"model: {e}") from None
    if hf is None:
        return
    check_max_model_len(config.max_model_len, hf)
    check_split(hf, config.tensor_parallel_size, config.pipeline_parallel_size)
    _check_experts(hf)
    if config.pipeline_parallel_size > 1 and config.runner == "auto":
        _check_not_pooling(config, hf)
    try:
        quant_method(config.quantization, hf, dummy=config.load_format == "dummy")
    except ValueError as e:
        why = str(e) if str(e).startswith("quantization") else f"quantization: {e}"
        raise ValueError(why) from None
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return
    from paged.spec_decode.draft import proposer_config

    try:
        draft = _read_config(proposer_config(config))
        if draft is None:
            raise ValueError(f"{spec.model!r} not found (a folder with config.json, a Hub id)")
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if spec.method == "draft_model" and draft.vocab_size != hf.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens) is "
            f"not the target's ({hf.vocab_size}): a draft needs the same tokenizer"
        )


def _check_experts(hf: Any) -> None:
    """A MoE config.json routing each token to more experts than it has (SparseMoE's rule)."""
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and 0 < experts < top_k:
        raise ValueError(f"model: num_experts_per_tok {top_k} exceeds the {experts} experts")


def _check_not_pooling(config: EngineConfig, hf: Any) -> None:
    """--runner auto with pipeline stages: refuse a checkpoint that would run as an embedding
    model (as the engine resolves it), which pipeline parallelism cannot serve."""
    from paged.model.pooling_config import resolve_runner

    src = None
    if config.load_format != "dummy":  # dummy: drawn weights, the head too (as the engine)
        from paged.model.loader import resolve_model

        try:
            src = resolve_model(config.model, config.load_format, config.revision,
                                config.download_dir)  # fmt: skip
        except (ValueError, OSError):
            return
    try:
        runner = resolve_runner(config.runner, hf, src)
    except Exception:  # noqa: BLE001 (unreadable files: the engine says why, as it would)
        return
    if runner == "pooling":
        raise ValueError(
            "runner: this checkpoint runs as an embedding model (--runner auto), which is not "
            "supported with pipeline_parallel_size > 1"
        )


def lora_model_shape(config: EngineConfig) -> tuple[int, int] | None:
    """(hidden size, layers) of the model, to check adapters against on load (None without
    --enable-lora or a config.json to read)."""
    if not config.enable_lora:
        return None
    try:
        hf = _read_config(config)
    except (ValueError, OSError):
        return None
    text = hf.get_text_config() if hf is not None else None
    hidden, layers = (getattr(text, k, None) for k in ("hidden_size", "num_hidden_layers"))
    return (hidden, layers) if hidden is not None and layers is not None else None


def parsing_options(args: argparse.Namespace) -> Any:
    """The tool-call and reasoning parsers the flags ask for; ValueError names the flag."""
    from paged.server.chat_parsing import ParsingOptions

    return ParsingOptions(
        getattr(args, "enable_auto_tool_choice", False),
        getattr(args, "tool_call_parser", None),
        getattr(args, "reasoning_parser", None),
    )


def build_serving(
    config: EngineConfig, args: argparse.Namespace, faults: Any = None, fleet: Any = None
) -> Serving:
    """Everything `Serving` needs, checked before the engine starts (StartError otherwise);
    the engine is made, not started. `args`: the parsing flags (add_parsing_args), and where
    the command has them `--router`, `--fleet`, `--ray-address`, `--max-prompt-chars`."""
    from paged.engine.generation_config import generation_defaults
    from paged.engine.llm import load_chat_template
    from paged.engine.replicas import make_engine
    from paged.server.errors import APIError
    from paged.server.lora_adapters import LoRAAdapters

    try:
        name, load_tok, model_path = tokenizer_loader(config)
        chat_template = load_chat_template(config.chat_template)
        gen_defaults = generation_defaults(
            config.generation_config, model_path, config.override_generation_config
        )
        parsing = parsing_options(args)
    except (ValueError, OSError) as e:
        raise StartError(f"cannot start: {e}") from None
    names = config.served_model_name or [name]
    loras = LoRAAdapters(config.enable_lora, config.max_lora_rank, lora_model_shape(config))
    for mod in config.lora_modules or []:  # read and checked before anything starts
        try:
            loras.load(mod["name"], mod["path"], names, mod.get("base_model_name"))
        except APIError as e:
            raise StartError(f"cannot start: --lora-modules {mod['name']}: {e.message}") from None
    router = getattr(args, "router", "prefix")
    if fleet is not None:  # replica groups by platform (paged.engine.fleet)
        from paged.engine.fleet import FleetError, build_fleet

        ray_address = getattr(args, "ray_address", None) or os.environ.get("RAY_ADDRESS")
        try:
            engine = build_fleet(fleet, config, args.log_level, load_tok, faults, router,
                                 args.fleet, ray_address)  # fmt: skip
        except FleetError as e:
            raise StartError(f"cannot start the fleet: {e}") from None
    else:  # data_parallel_size of them
        engine = make_engine(config, args.log_level, load_tok, faults, router)
    serving = Serving(engine, names, chat_template, getattr(args, "max_prompt_chars", None))
    serving.parsing = parsing
    serving.loras = loras
    serving.generation_defaults = gen_defaults
    if gen_defaults:
        log.info("sampling defaults from the generation config: %s", gen_defaults)
    return serving
