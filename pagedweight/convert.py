"""`pagedweight convert SRC OUT --calib FILE`: HF MoE checkpoint -> AP checkpoint directory.

Stages (each with a progress bar): load, calibrate (cached in OUT), capture the residual-head sequences, quantize +
pack every expert block layer by layer on the chosen device (measuring each block's per-sequence damage of every
width drop as it goes), fit the planner's prompt residual heads, write dense weights and the manifest.

Memory on the device, for P parameters of which X are expert weights: the model, P x 4 bytes in float32 (the
default --dtype) or P x 2 in bfloat16 / float16; with --sensitivity fisher also X x 4 bytes of float32 Fisher sums
and about one layer's expert gradients in the model's dtype (activation: sums of a few MB). Computed for
Qwen1.5-MoE-A2.7B (P = 14.3 B, X = 12.5 B): float32 + fisher 107 GB, bfloat16 + fisher 79 GB (73 GiB before
gradients and activations: tight on an 80 GB H100), float32 + activation 57 GB, bfloat16 + activation 29 GB; for
Mixtral-8x7B (P = 46.7 B, X = 45.1 B): bfloat16 + activation 93 GB, bfloat16 + fisher 274 GB.
A 16-bit --dtype runs the calibration passes in it; statistics and damage measurements stay float32, and the
quantizer and the written dense weights take the checkpoint's own values (read again from it, a layer's experts at
a time, where the calibration dtype cannot hold them: a float32 checkpoint calibrated in bfloat16).
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import time
from pathlib import Path
from typing import Callable

import torch
from loguru import logger
from tqdm import tqdm

from pagedweight.apformat import MANIFEST, VERSION, APWriter
from pagedweight.bitplanes import dequantize
from pagedweight.calibrate import CACHE_VERSION, KINDS, DamageProbe, cached_calibrate, calibration_batches
from pagedweight.checkpoint import TensorFiles, read_parameter, read_state_dict, resolve_model
from pagedweight.models.config import DTYPE_NAMES, parse_dtype
from pagedweight.pool import release_cached
from pagedweight.quantize import QuantizedBlock, quantize_blocks

# Row-batch size of one quantizer call, in weights: the quantizer needs ~100 bytes of scratch per weight.
DEFAULT_BATCH_WEIGHTS = 1 << 25
# --dtype: the model's dtype for calibration (auto: the checkpoint's own, config.json's dtype / torch_dtype)
LOAD_DTYPES = ("float32", "bfloat16", "float16", "auto")

# The dtype `ap_checkpoint_for` converts in: the checkpoint's own, as released (bfloat16 for the Qwen MoE models):
# in float32 Qwen1.5-MoE-A2.7B's conversion needs 107 GB, more than an H100 holds, in bfloat16 79 GB (computed,
# module docstring). Its statistics agree with float32's to a Pearson correlation of 0.9997 on the bundled model
# (tests/test_calibrate.py).
AUTO_CONVERT_DTYPE = "auto"


def quantize_layer(writer: APWriter, layer: int, gate_up: torch.Tensor, down: torch.Tensor,
                   sensitivity: Callable[[int, str], torch.Tensor | None], device: torch.device,
                   batch_weights: int = DEFAULT_BATCH_WEIGHTS,
                   on_block: Callable[[int, str, QuantizedBlock], None] | None = None) -> tuple[float, float]:
    """Quantize the E gate_up [E, 2F, D] and down [E, D, F] blocks of one layer and stream them to `writer`.

    Experts of one kind share K, so as many as fit in `batch_weights` go through the quantizer as one row batch.
    `sensitivity(expert, kind)` gives the block's sensitivity ([K], [N, K] or None); `on_block(expert, kind,
    block)` sees every quantized block before it is written.
    Returns (seconds quantizing and packing, seconds writing).
    """
    quantize_s = write_s = 0.0
    for kind, weights in (("gate_up", gate_up), ("down", down)):
        n_exp, n, k = weights.shape
        per_batch = max(1, batch_weights // (n * k))
        for start in range(0, n_exp, per_batch):
            ids = range(start, min(start + per_batch, n_exp))
            t0 = time.perf_counter()
            try:
                blocks = quantize_blocks([weights[e].detach().float() for e in ids],
                                         [sensitivity(e, kind) for e in ids], writer.seed_bits, writer.parent_bits,
                                         device=device)
            except ValueError as exc:  # weights beyond float16, NaN: say which blocks
                raise ValueError(f"layer {layer} {kind} of experts {ids.start}-{ids.stop - 1}: {exc}") from exc
            t1 = time.perf_counter()
            for e, blk in zip(ids, blocks):
                if on_block is not None:
                    on_block(e, kind, blk)
                writer.add_block(layer, e, kind, blk, k)
            quantize_s, write_s = quantize_s + t1 - t0, write_s + time.perf_counter() - t1
    return quantize_s, write_s


def convert(src: str | Path, out: str | Path, calib: str | Path, seed_bits: int = 3, parent_bits: int = 8,
            sensitivity: str = "fisher", num_seqs: int = 64, seq_len: int = 256,
            device: str | torch.device | None = None, batch_weights: int = DEFAULT_BATCH_WEIGHTS,
            heads_seqs: int = 32, dtype: str | torch.dtype = "float32") -> Path:
    """Convert the HF checkpoint `src` into an AP checkpoint in `out`; returns the manifest path.

    Calibration sequences are spread evenly over the calibration text (`calibration_batches`); the planner's
    prompt residual heads are fitted on min(`heads_seqs`, `num_seqs`) sequences spread the same way (0: none; the
    planner then runs on the global estimate). `dtype` is the dtype the model is loaded and calibrated in
    ("auto": the checkpoint's own); see the module's docstring for what each needs.
    """
    from pagedweight.checkpoint import TOKENIZER, read_config, weight_files
    from pagedweight.knobs import PlannerKnobs
    from pagedweight.models import load_model
    from pagedweight.tokenizer import TextTokenizer

    src, out = Path(src), Path(out)
    # bad input is refused before the model loads and calibrates (minutes for a large one), not after
    if not 1 <= seed_bits <= parent_bits <= 8:
        raise ValueError(f"need 1 <= seed_bits <= parent_bits <= 8, got {seed_bits}, {parent_bits}")
    if sensitivity not in KINDS:
        raise ValueError(f"sensitivity must be one of {KINDS}, got {sensitivity!r}")
    if dtype != "auto":
        try:
            dtype = parse_dtype(dtype)
        except ValueError:
            raise ValueError(f"dtype must be one of {', '.join(LOAD_DTYPES)}, got {dtype!r}") from None
    if not Path(calib).is_file():
        raise FileNotFoundError(f"{calib}: calibration text not found")
    if (src / MANIFEST).is_file():
        raise ValueError(f"{src}: already an AP checkpoint (it has a {MANIFEST}); convert its HF source")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.resolve() == src.resolve():
        raise ValueError(f"{out}: the output directory is the source directory; give the AP checkpoint its own")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cfg = read_config(src)
    tok = TextTokenizer.from_dir(src)
    dtype = cfg.dtype if dtype == "auto" else dtype
    if dtype == torch.float16 and sensitivity == "fisher":
        logger.warning("float16 gradients below 6e-8 flush to zero and above 65504 overflow: bfloat16 has float32's "
                       "range at the same memory")
    model = load_model(src, dtype=dtype, device=device)
    timings["load_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # the calibration text's token ids come from tokenizer.json: another tokenizer, other statistics. Only the
    # weight files the model came from are hashed: not a Mistral repository's consolidated*.safetensors (the same
    # weights again, ~93 GB for Mixtral-8x7B) nor any other stray safetensors file beside them
    files = [src / "config.json", src / TOKENIZER, *weight_files(src)]
    stats = cached_calibrate(model, files, calib, out, sensitivity, num_seqs, seq_len, tok.encode)
    timings["calibrate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    probe = None
    if min(heads_seqs, num_seqs) > 0:
        batches = calibration_batches(tok.encode(Path(calib).read_text(encoding="utf-8")), min(heads_seqs, num_seqs),
                                      seq_len)
        probe = DamageProbe(model, seed_bits, parent_bits).capture(batches)
    timings["heads_capture_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    writer = APWriter(out, cfg.raw, cfg.family, cfg.num_hidden_layers, cfg.num_experts, seed_bits, parent_bits)
    # a model whose dtype cannot hold the checkpoint's values (float32 calibrated in bfloat16) quantizes the
    # checkpoint's experts, read again layer by layer, not the calibration dtype's rounding of them
    files = None if _holds_checkpoint(model, cfg) else TensorFiles(src)
    for l in tqdm(range(cfg.num_hidden_layers), desc="quantize", unit="layer"):
        experts = model.layers[l].mlp.experts
        gate_up, down = experts.gate_up, experts.down
        if files is not None:
            gate_up, down = (read_parameter(files, cfg, f"layers.{l}.mlp.experts.{kind}", w.shape)
                             for kind, w in (("gate_up", gate_up), ("down", down)))

        def sens(e: int, kind: str, l: int = l) -> torch.Tensor:
            return stats.block(l, e, kind)

        def measure(e: int, kind: str, blk: QuantizedBlock, l: int = l) -> None:
            k = getattr(experts, kind).shape[2]
            planes = blk.planes.to(device)  # the probe's dequantizes and products where the model runs, not the host
            probe.measure(l, e, kind, lambda b: dequantize(planes, blk.luts[b].to(device), b, k))

        quantize_layer(writer, l, gate_up, down, sens, device, batch_weights,
                       measure if probe is not None else None)
    heads = probe.fit() if probe is not None else None
    timings["quantize_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    dense = {k: v.to(cfg.dtype) for k, v in _dense_state(src, cfg, model).items()
             if ".mlp.experts." not in k and not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    calibration = {"sensitivity": sensitivity, "dtype": DTYPE_NAMES[dtype],
                   "num_seqs": int(stats.tokens // seq_len), "seq_len": seq_len,
                   "tokens": stats.tokens, "calib_file": Path(calib).name,
                   "routed_tokens": stats.routed_tokens.tolist(),
                   "residual_heads": {"seqs": 0 if probe is None else len(probe.features), "seq_len": seq_len}}
    path = writer.finish(stats.routing_mass.numpy(), dense, src, planner_knobs=PlannerKnobs().to_dict(),
                         calibration=calibration, residual_heads=heads)
    timings["write_s"] = time.perf_counter() - t0
    logger.info("AP checkpoint written to {} ({})", out,
                ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in timings.items()))
    return path


def _holds_checkpoint(model: torch.nn.Module, cfg) -> bool:
    """Whether the model's dtype holds the checkpoint's values exactly (float32, or the checkpoint's own dtype)."""
    return next(model.parameters()).dtype in (torch.float32, cfg.dtype)


def _dense_state(src: Path, cfg, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's dense (non-expert) tensors at the checkpoint's precision: the model's own where its dtype holds
    the checkpoint's values, else read again from `src` onto the CPU (a float32 checkpoint calibrated in bfloat16
    must not have its dense weights rounded to bfloat16)."""
    state = model.state_dict()
    if _holds_checkpoint(model, cfg):
        return state
    expected = {k: v.shape for k, v in state.items() if ".mlp.experts." not in k}
    return read_state_dict(src, cfg, expected, cfg.dtype, "cpu", warn_unused=False)  # the experts: read apart


def conversion_device_bytes(cfg, dtype: torch.dtype, sensitivity: str) -> int:
    """Device bytes a conversion holds at least (computed from the model's parameter counts, meta tensors): the
    model in `dtype` and, with Fisher, float32 sums of every expert weight. Gradients, activations and the
    quantizer's scratch come on top (about one layer's expert gradient in `dtype`, the module docstring)."""
    from pagedweight.models import MoEForCausalLM

    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.layers for p in layer.mlp.experts.parameters())
    return params * dtype.itemsize + (experts * 4 if sensitivity == "fisher" else 0)


# `ap_checkpoint_for` calibrates with Fisher statistics only where the model and the sums fit the GPU's free memory
# with this share to spare (gradients, activations, the quantizer's scratch); else with activation statistics
AUTO_FISHER_HEADROOM = 0.15


def auto_sensitivity(model_dir: Path, device: str) -> str:
    """The sensitivity `ap_checkpoint_for` converts with: Fisher (Any-Precision LLM's), unless on a GPU whose free
    memory cannot hold the model and its Fisher sums (Qwen1.5-MoE-A2.7B: 79 GB in bfloat16, computed; an 80 GB H100
    has less free): then activation statistics (forward passes only), with a warning saying how to get Fisher's."""
    from pagedweight.checkpoint import read_config

    dev = torch.device(device)
    if dev.type != "cuda":
        return "fisher"
    cfg = read_config(model_dir)
    need = conversion_device_bytes(cfg, cfg.dtype, "fisher")
    free, _ = torch.cuda.mem_get_info(dev)
    if need * (1 + AUTO_FISHER_HEADROOM) <= free:
        return "fisher"
    logger.warning("{}: Fisher calibration needs {:.1f} GB of the GPU and more for gradients ({:.1f} GB free): "
                   "calibrating with activation statistics instead (forward passes only, {:.1f} GB). For Fisher's, "
                   "convert it on a larger GPU with `pagedweight convert --dtype auto` and serve that directory",
                   model_dir, need / 1e9, free / 1e9, conversion_device_bytes(cfg, cfg.dtype, "activation") / 1e9)
    return "activation"


def source_fingerprint(model_dir: Path, calib: Path | None = None, sensitivity: str = "fisher") -> str:
    """Short digest of a HF directory's files (name, size, modification time), of the calibration text and of the
    converter's versions and planner defaults (written into the manifest): a retrained or replaced model, or a
    conversion that changed (its sensitivity too), gets a cache entry of its own, never a stale one. Sizes and
    times, not contents: hashing a large checkpoint on every start would cost minutes."""
    from pagedweight.knobs import PlannerKnobs

    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file())
    text = hashlib.blake2b(calib.read_bytes(), digest_size=8).hexdigest() if calib is not None else None
    knobs = sorted(PlannerKnobs().to_dict().items())
    settings = (AUTO_CONVERT_DTYPE,) if sensitivity == "fisher" else (AUTO_CONVERT_DTYPE, sensitivity)
    return hashlib.blake2b(repr((files, VERSION, CACHE_VERSION, text, knobs, *settings)).encode(),
                           digest_size=6).hexdigest()


def ap_checkpoint_for(model_dir: Path, cache_dir: Path, device: str) -> Path:
    """An AP checkpoint for `model_dir`: itself if it is one, else converted once into `cache_dir` (in its own dtype,
    with `auto_sensitivity`'s statistics; an entry converted before, of either kind, is used as it is)."""
    if (model_dir / MANIFEST).is_file():
        return model_dir
    from pagedweight.corpus import DATA_DIR

    calib = DATA_DIR / "calib.txt"

    def entry(sensitivity: str) -> Path:
        return cache_dir / f"{model_dir.resolve().name}-ap-{source_fingerprint(model_dir, calib, sensitivity)}"

    for kind in ("fisher", "activation"):  # a converted entry is used without asking the GPU (a CUDA context in
        if (entry(kind) / MANIFEST).is_file():  # `serve`'s driver would take memory from the engine beside it)
            return entry(kind)
    sensitivity = auto_sensitivity(model_dir, device)
    out = entry(sensitivity)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{out.name}.lock", "w") as lock:  # two processes starting on one model convert it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MANIFEST).is_file():
            return out
        logger.info("{} is a HF checkpoint: converting it to any-precision planes in {}", model_dir, out)
        convert(model_dir, out, calib, sensitivity=sensitivity, device=device, dtype=AUTO_CONVERT_DTYPE)
        if torch.device(device).type == "cuda":
            # the conversion's cuBLAS workspaces (64 MiB on the H200) and cached segments would otherwise shape where
            # the engine built next in this process puts its weights: the bundled model's first `pagedweight run`
            # on a machine measured a 94 MiB reserve instead of 74 and peaked 12 MiB above 134 MiB
            # (run_budgets-nvidia-h200-20261201-s26-32x64.json, row 1; probe in h200-nvidia-h200-20261201-s26.log)
            release_cached(torch.device(device))
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="convert a HF MoE checkpoint into an any-precision (AP) checkpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory (config.json, safetensors, tokenizer.json) or a Hugging Face "
                               "Hub repository id")
    p.add_argument("out", type=Path, help="output AP checkpoint directory")
    p.add_argument("--calib", type=Path, required=True, help="calibration text file")
    p.add_argument("--seed-bits", type=int, default=3, help="seed width s (default 3)")
    p.add_argument("--parent-bits", type=int, default=8, help="parent width P <= 8 (default 8)")
    p.add_argument("--sensitivity", choices=KINDS, default="fisher",
                   help="fisher: squared per-sequence gradients (as Any-Precision LLM); "
                        "activation: diag(X^T X) of routed inputs, no backward pass (default fisher)")
    p.add_argument("--num-seqs", type=int, default=64, help="calibration sequences (default 64)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.add_argument("--heads-seqs", type=int, default=32,
                   help="calibration sequences the planner's prompt residual heads are fitted on (0: no heads; "
                        "at most --num-seqs; default 32)")
    p.add_argument("--dtype", choices=LOAD_DTYPES, default="float32",
                   help="dtype the model is loaded and calibrated in; auto: the checkpoint's own (config.json). "
                        "Device memory: the model takes 4 bytes per parameter in float32, 2 in bfloat16/float16; "
                        "--sensitivity fisher adds 4 bytes per expert weight (float32 sums, whatever the dtype), "
                        "activation a few MB (Qwen1.5-MoE-A2.7B: 107 GB float32 + fisher, 79 GB bfloat16 + "
                        "fisher, 29 GB bfloat16 + activation). Statistics are accumulated in float32/float64 and "
                        "the experts quantized and the dense weights written at the checkpoint's precision either "
                        "way; float16 gradients can "
                        "underflow or overflow: prefer bfloat16 (default float32)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    return p


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.seed_bits <= args.parent_bits <= 8:
        raise ValueError("need 1 <= --seed-bits <= --parent-bits <= 8")
    if args.heads_seqs < 0:
        raise ValueError("--heads-seqs must be >= 0")
    if args.num_seqs < 1 or args.seq_len < 2:
        raise ValueError("need --num-seqs >= 1 and --seq-len >= 2 (a sequence predicts its tokens after the first)")
    if not args.calib.is_file():  # before the model loads (seconds to minutes for a large one)
        raise FileNotFoundError(f"--calib {args.calib}: no such file")
    convert(resolve_model(args.src), args.out, args.calib, args.seed_bits, args.parent_bits, args.sensitivity,
            args.num_seqs, args.seq_len, args.device, heads_seqs=args.heads_seqs, dtype=args.dtype)
    return 0
