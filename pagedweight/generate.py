"""Dense generate loop (no paging): prefill once into a DenseKVCache, then one token per step.

Also the `pagedweight generate` subcommand (add_parser / run), served by `pagedweight.engine.LLM` (the same
engine as `pagedweight run`, one request); the loop here stays as the simple reference the tests compare with.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from loguru import logger

from pagedweight.models import DenseKVCache, MoEForCausalLM, parse_dtype
from pagedweight.sampling import Sampler, SamplingParams, make_generator


@torch.inference_mode()
def generate(model: MoEForCausalLM, prompt_ids: list[list[int]], params: SamplingParams,
             eos_token_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Continue each prompt (all of one length: the dense cache has no padding) by up to params.max_tokens.

    Returns the new tokens per row; a row stops after its first eos token (kept, as transformers does)
    unless params.ignore_eos. Seeded rows draw from their own generator (seed + row).
    """
    params.validate()
    if not prompt_ids or any(len(p) != len(prompt_ids[0]) for p in prompt_ids) or not prompt_ids[0]:
        raise ValueError("prompts must be non-empty and of equal length")
    cfg = model.config
    device = model.embed_tokens.weight.device
    b, t = len(prompt_ids), len(prompt_ids[0])
    if t + params.max_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({t}) + max_tokens ({params.max_tokens}) exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    cache = DenseKVCache.allocate(cfg, b, t + params.max_tokens, model.embed_tokens.weight.dtype, device)
    generators = [make_generator(None if params.seed is None else params.seed + row, device) for row in range(b)]
    sampler = Sampler()
    logits = model(torch.tensor(prompt_ids, device=device), cache=cache)[:, -1]
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(params.max_tokens):
        history = [np.asarray(o, dtype=np.int64) for o in out] if params.reads_history else None
        seen = [np.asarray(prompt_ids[row] + out[row], dtype=np.int64) for row in range(b)] \
            if params.repetition_penalty != 1.0 else None
        tokens = sampler(logits, [params] * b, generators, history, eos_token_ids, seen)
        for row, tok in enumerate(tokens):
            if not done[row]:
                out[row].append(tok)
                done[row] = len(out[row]) >= params.min_tokens and (
                    tok in params.stop_token_ids or tok in eos_token_ids and not params.ignore_eos)
        if all(done) or step == params.max_tokens - 1:
            break
        logits = model(torch.tensor(tokens, device=device)[:, None], cache=cache)[:, -1]
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="generate text from a prompt with a local HF MoE checkpoint (dense weights, no paging)",
        description="Load a Hugging Face MoE checkpoint directory (qwen2_moe, mixtral, qwen3_moe, olmoe) and "
                    "continue a prompt. The completion goes to stdout, logs to stderr.")
    p.add_argument("--model", required=True, metavar="DIR|ORG/NAME",
                   help="model directory (config.json, model.safetensors or shards + index, tokenizer.json) or a "
                        "Hugging Face Hub repository id")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (must not be empty)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the checkpoint's chat template and print the reply")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="most new tokens to generate; stops earlier at an eos token (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the most likely token every step (greedy; default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches P, in (0, 1] "
                        "(default: 1 = off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only among the K most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed for sampling, makes sampled output repeatable (default: none)")
    p.add_argument("--dtype", default="bfloat16", metavar="DTYPE",
                   help="weight/activation dtype: float32 | bfloat16 | float16 (default: bfloat16)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="torch device to run on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    return p


def run(args: argparse.Namespace) -> int:
    """Validate the options (ValueError = bad input), serve the prompt with the engine, print the completion."""
    from pagedweight.checkpoint import read_config, resolve_model
    from pagedweight.engine import round_up
    from pagedweight.kv_cache import kv_layer_block_bytes
    from pagedweight.pool import PAGE_ALIGN
    from pagedweight.run import engine
    from pagedweight.tokenizer import TextTokenizer

    args.model = resolve_model(args.model)
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed).validate()
    dtype = parse_dtype(args.dtype)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
    tokenizer = TextTokenizer.from_dir(args.model)
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to zero tokens")
    cfg = read_config(args.model)
    total = len(prompt_ids) + params.max_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    block = 16  # KV cache sized to this one request (plus a block of slack), the only one served
    page = round_up(kv_layer_block_bytes(cfg, block, dtype), PAGE_ALIGN)
    kv_bytes = (-(-total // block) + 1) * page * cfg.num_hidden_layers
    # an AP checkpoint's planes go through the node page store: one this run wrote is removed at the end
    with engine(args.model, device=str(device), dtype=str(dtype).removeprefix("torch."), block_size=block,
                max_num_seqs=1, max_model_len=total, kv_cache_bytes=kv_bytes) as llm:
        start = time.perf_counter()
        out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        text = llm.tokenizer.decode(out.token_ids)
    if out.finish_reason == "error":
        raise ValueError(out.error)
    logger.info("{} prompt tokens, {} new tokens in {:.2f} s ({:.1f} tokens/s)", len(prompt_ids),
                out.completion_tokens, elapsed, out.completion_tokens / elapsed if elapsed > 0 else 0.0)
    sys.stdout.write(text + "\n")
    return 0
