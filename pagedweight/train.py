"""Train the project's own Qwen2-MoE model: byte-level BPE tokenizer + MoE LM on the Python corpus.

No weights can be downloaded on these machines and random weights have no quality to lose, so the
bundled model (config `tiny`, models/pw-tiny-moe/) and a larger benchmark model (config `large`)
come from this script. It is seeded, logs with loguru, checkpoints every few hundred steps (and on
exit) so `--resume` continues a run, evaluates perplexity on the committed slices in data/, measures
the routing-mass spread on the calibration slice and writes one result JSON (benchmarks/common.py).

The step budget is fixed before the cosine schedule starts: `max_steps`, or fewer when
`time_budget_s` says so (the step time is measured over the first steps, then frozen and stored in
the checkpoint, so a resumed run follows the same schedule).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from loguru import logger

from pagedweight import corpus
from pagedweight.cli import HelpFormatter

EOS = "<|endoftext|>"
# No trailing newline: the byte-level pre-tokenizer merges "\n" with the next line's indentation, so a
# prompt ending in a bare "\n" tells the model the next line starts at column 0.
PROMPTS = (
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(root):",
)


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation recipe of one named configuration."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    context: int
    batch_size: int  # sequences of `context` tokens per step
    lr: float
    min_lr_frac: float
    warmup_steps: int
    weight_decay: float
    max_steps: int
    time_budget_s: float  # training wall-time cap (step budget fixed after the first steps)
    aux_loss_coef: float  # Switch load-balancing loss, kept small so routing stays specialised
    corpus_bytes: int  # training text cap (uniform sample of the train split)
    tokenizer_bytes: int  # text used to train the BPE tokenizer
    site_packages: bool  # add permissively licensed site-packages to the training split
    rope_theta: float = 10000.0
    norm_topk_prob: bool = False  # Qwen1.5-MoE default
    seed: int = 0


CONFIGS: dict[str, TrainConfig] = {
    # The bundled model: <= 12 MB in bf16 with tied embeddings (5.6M params, 4 layers x 16 experts, top-2).
    "tiny": TrainConfig(
        name="tiny", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        num_experts=16, top_k=2, moe_intermediate_size=64, shared_intermediate_size=192, context=1024,
        batch_size=64, lr=3e-3, min_lr_frac=0.05, warmup_steps=150, weight_decay=0.1, max_steps=8000,
        time_budget_s=420.0, aux_loss_coef=1e-3, corpus_bytes=200_000_000, tokenizer_bytes=40_000_000,
        site_packages=True),
    # Benchmark model for quality curves (261M total, 63M active); not committed. 360 s of training +
    # data preparation + evaluation stay under 8 minutes on one H200.
    "large": TrainConfig(
        name="large", vocab_size=4096, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4,
        num_experts=32, top_k=4, moe_intermediate_size=384, shared_intermediate_size=1024, context=1024,
        batch_size=32, lr=1e-3, min_lr_frac=0.1, warmup_steps=200, weight_decay=0.1, max_steps=3000,
        time_budget_s=360.0, aux_loss_coef=1e-3, corpus_bytes=200_000_000, tokenizer_bytes=40_000_000,
        site_packages=True),
    # CPU smoke test of the whole pipeline (tests / CI); same code path, minutes on 2 cores.
    "micro": TrainConfig(
        name="micro", vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        num_experts=4, top_k=2, moe_intermediate_size=32, shared_intermediate_size=64, context=128,
        batch_size=4, lr=3e-3, min_lr_frac=0.1, warmup_steps=5, weight_decay=0.1, max_steps=20,
        time_budget_s=600.0, aux_loss_coef=1e-3, corpus_bytes=2_000_000, tokenizer_bytes=500_000,
        site_packages=False),
}


# ----------------------------------------------------------------------------------------- data


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer) with `<|endoftext|>` as its only special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def data_cache_paths(cfg: TrainConfig, work: Path) -> tuple[Path, Path]:
    """Where `prepare_data` keeps the tokenizer and the token array: named by what they are built from (vocabulary,
    text sizes, site-packages), so configurations sharing a work directory never read each other's (a `tiny` run
    after `micro` trained on micro's 512-token vocabulary)."""
    key = f"v{cfg.vocab_size}-t{cfg.tokenizer_bytes}-c{cfg.corpus_bytes}{'-site' if cfg.site_packages else ''}"
    return work / f"tokenizer-{key}.json", work / f"tokens-{key}.npy"


def prepare_data(cfg: TrainConfig, work: Path):
    """Tokenizer + flat training token array (uint16, documents separated by EOS), cached in `work`."""
    from tokenizers import Tokenizer

    tok_path, tok_arr = data_cache_paths(cfg, work)
    docs = None
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
        logger.info("reusing tokenizer {}", tok_path)
    else:
        t0 = time.time()
        docs = corpus.training_documents(cfg.site_packages, cfg.corpus_bytes)
        sample, size = [], 0
        for _, text in docs:  # docs are in path-hash order: a prefix is a uniform sample
            if size >= cfg.tokenizer_bytes:
                break
            sample.append(text)
            size += len(text)
        tok = train_tokenizer(sample, cfg.vocab_size)
        tok.save(str(tok_path))
        logger.info("tokenizer: vocab {} from {:.1f} MB in {:.1f}s", tok.get_vocab_size(), size / 1e6, time.time() - t0)
    if tok_arr.exists():
        ids = np.load(tok_arr)
    else:
        t0 = time.time()
        docs = docs if docs is not None else corpus.training_documents(cfg.site_packages, cfg.corpus_bytes)
        eos = tok.token_to_id(EOS)
        encs = tok.encode_batch([text for _, text in docs], add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids + [eos], dtype=np.uint16) for e in encs])
        np.save(tok_arr, ids)
        n_site = sum(rel.startswith("site-packages/") for rel, _ in docs)
        logger.info("corpus: {} files ({} stdlib, {} site-packages), {:.1f} MB -> {:.2f}M tokens in {:.1f}s",
                    len(docs), len(docs) - n_site, n_site, sum(len(t) for _, t in docs) / 1e6, len(ids) / 1e6,
                    time.time() - t0)
    return tok, ids


# ---------------------------------------------------------------------------------------- model


def model_config(cfg: TrainConfig, vocab_size: int, eos_id: int):
    """The HF-family description (Qwen2-MoE: qkv bias, sigmoid-gated shared expert, tied embeddings)."""
    from pagedweight.models import ModelConfig

    return ModelConfig(
        family="qwen2_moe", vocab_size=vocab_size, hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_experts=cfg.num_experts, top_k=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, rope_theta=cfg.rope_theta, rms_norm_eps=1e-6,
        max_position_embeddings=cfg.context, shared_expert_intermediate_size=cfg.shared_intermediate_size,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_ids=(eos_id,), dtype=torch.bfloat16,
        qkv_bias=True)


def count_params(model: torch.nn.Module, cfg: TrainConfig) -> tuple[int, int]:
    """(total, active per token): active counts top_k of the routed experts."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, total - routed + routed * cfg.top_k // cfg.num_experts


class SortedExperts(torch.nn.Module):
    """Training-time execution of a `DenseExperts`' own Parameters: the routed (token, slot) pairs are
    sorted by expert once and cut into per-expert segments, so a layer costs one host sync (the segment
    sizes) where `DenseExperts.forward` syncs once per expert. Same math, same tensors: gradients land in
    the DenseExperts that `save_hf` writes (it is swapped back in after training)."""

    def __init__(self, dense: torch.nn.Module) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.dense.gate_up, self.dense.down
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # the one host sync
        tok = order // topk_ids.shape[1]
        outs = []
        for e, seg in enumerate(x[tok].split(counts)):
            if seg.shape[0]:
                gate, up = F.linear(seg, gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, down[e]))
        y = torch.cat(outs) * topk_weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))


class RouterStats:
    """Router observer: routing mass per (layer, expert) and, in training, the Switch balance loss.

    m[l, e] = sum over tokens and slots of the routing weight given to e (DESIGN.md §2), normalised
    per layer when read. The balance loss E * sum_e f_e * P_e uses the full router softmax, recomputed
    from the expert input with the layer's own gate so gradients reach the router.
    """

    def __init__(self, model, num_layers: int, num_experts: int, with_loss: bool):
        self.model, self.with_loss = model, with_loss
        self.mass = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.aux: list[torch.Tensor] = []

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        E = self.mass.shape[1]
        if self.with_loss:
            probs = torch.softmax(self.model.layers[layer].mlp.gate(x).float(), dim=-1)
            ids = topk_ids.reshape(-1)  # index_add, not bincount: bincount syncs with the host on CUDA
            frac = torch.zeros(E, device=ids.device).index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            frac = frac / ids.numel()
            self.aux.append(E * (frac * probs.mean(0)).sum())
        else:
            w = topk_weights.detach().float().reshape(-1)
            self.mass[layer] += torch.zeros(E, device=w.device).index_add_(0, topk_ids.reshape(-1), w).double().cpu()

    def take_aux(self) -> torch.Tensor:
        loss = torch.stack(self.aux).sum()
        self.aux.clear()
        return loss


def routing_summary(mass: torch.Tensor) -> list[dict]:
    """Per-layer spread of normalised routing mass: max, min, max/min, entropy, top-quarter share."""
    rows = []
    E = mass.shape[1]
    for layer, m in enumerate(mass):
        p = (m / m.sum()).double()
        nz = p[p > 0]
        ent = float(-(nz * nz.log()).sum())
        top_q = float(p.sort(descending=True).values[: max(1, E // 4)].sum())
        rows.append(dict(layer=layer, max_mass=float(p.max()), min_mass=float(p.min()),
                         max_over_min=float(p.max() / p.min()) if p.min() > 0 else float("inf"),
                         entropy_nats=ent, entropy_frac_of_uniform=ent / math.log(E),
                         top_quarter_mass_frac=top_q, experts_below_quarter_uniform=int((p < 0.25 / E).sum())))
    return rows


# ------------------------------------------------------------------------------------ evaluate


@torch.no_grad()
def evaluate_text(model, tok, text: str, context: int, device: str, batch: int = 16,
                  observer: RouterStats | None = None) -> dict:
    """Perplexity over non-overlapping `context`-token windows of `text` (fp32), plus bits per byte."""
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    n_win = max(1, (len(ids) - 1) // context)
    nll, count = 0.0, 0
    if observer is not None:
        model.set_router_observer(observer)
    try:
        for s in range(0, n_win, batch):
            wins = [ids[i * context: i * context + context + 1] for i in range(s, min(n_win, s + batch))]
            L = min(len(w) for w in wins)
            x = torch.stack([w[:L] for w in wins]).to(device)
            logits = model(x[:, :-1])
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                                         reduction="sum"))
            count += x[:, 1:].numel()
    finally:
        if observer is not None:
            model.set_router_observer(None)
    n_bytes = len(text.encode()) * count / max(1, len(ids) - 1)  # bytes covered by the scored tokens
    return dict(tokens=count, nll_per_token=nll / count, ppl=math.exp(nll / count),
                bits_per_byte=nll / math.log(2) / n_bytes)


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int, device: str) -> str:
    """Greedy continuation by re-running the whole prefix (no cache: the simplest correct reference)."""
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], dtype=torch.long, device=device)
    n_prompt, eos, ctx = ids.shape[1], tok.token_to_id(EOS), model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        nxt = model(ids[:, -ctx:])[:, -1].argmax(-1, keepdim=True)
        if int(nxt) == eos:
            break
        ids = torch.cat([ids, nxt], dim=1)
    return tok.decode(ids[0, n_prompt:].tolist())


# ---------------------------------------------------------------------------------------- train


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then cosine decay to `min_lr_frac * lr` at `total`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig, work: Path, device: str, resume: bool, ckpt_every: int = 500,
          log_every: int = 50) -> dict:
    """Run (or resume) training; returns the trained model, tokenizer and the run's figures."""
    from pagedweight.models import build_model

    seed_everything(cfg.seed)
    work.mkdir(parents=True, exist_ok=True)
    tok, ids = prepare_data(cfg, work)
    eos = tok.token_to_id(EOS)
    mcfg = model_config(cfg, tok.get_vocab_size(), eos)
    model = build_model(mcfg, seed=cfg.seed).to(device=device, dtype=torch.float32)
    total, active = count_params(model, cfg)
    logger.info("model {}: {:.2f}M params ({:.2f}M active), {} train tokens", cfg.name, total / 1e6,
                active / 1e6, len(ids))
    dense = [layer.mlp.experts for layer in model.layers]
    for i, experts in enumerate(dense):
        model.set_experts(i, SortedExperts(experts))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.startswith("cuda"))
    gen = torch.Generator().manual_seed(cfg.seed)
    step, total_steps, spent_s, losses = 0, None, 0.0, []
    ckpt = work / f"ckpt-{cfg.name}.pt"
    if resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"].cpu())  # a CPU generator's state (map_location moved it with the rest)
        step, total_steps, spent_s, losses = state["step"], state["total_steps"], state["spent_s"], state["losses"]
        logger.info("resumed {} at step {} of {}", ckpt, step, total_steps)

    def save_ckpt() -> None:
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), gen=gen.get_state(), step=step,
                        total_steps=total_steps, spent_s=spent_s, losses=losses, cfg=dataclasses.asdict(cfg)),
                   ckpt)

    data = torch.from_numpy(ids.astype(np.int32)).to(device)
    T, B = cfg.context, cfg.batch_size
    offs = torch.arange(T + 1, device=device)
    stats = RouterStats(model, cfg.num_layers, cfg.num_experts, with_loss=cfg.aux_loss_coef > 0)
    model.set_router_observer(stats if cfg.aux_loss_coef > 0 else None)
    use_amp = device.startswith("cuda")
    model.train()
    t_start = time.time() - spent_s
    # the speed probe times probe_steps steps from step 5, or from the first step after a resume that came before
    # the step budget was fixed (its probe did not finish)
    t_probe, probe_steps, probe_start = None, 20, max(5, step + 1)
    while total_steps is None or step < total_steps:
        starts = torch.randint(0, len(ids) - T - 1, (B,), generator=gen).to(device)
        batch = data[starts[:, None] + offs].long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, total_steps or cfg.max_steps)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(batch[:, :-1])
            lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
            aux = stats.take_aux() / cfg.num_layers if cfg.aux_loss_coef > 0 else torch.zeros((), device=device)
            loss = lm_loss + cfg.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            losses.append((step, lm_loss.item(), aux.item()))
        if total_steps is None:  # fix the step budget from the measured speed, before cosine decay starts
            if step == probe_start:
                if use_amp:
                    torch.cuda.synchronize()
                t_probe = time.time()
            elif step == probe_start + probe_steps or (step > probe_start and step >= cfg.warmup_steps):
                if use_amp:
                    torch.cuda.synchronize()
                per_step = (time.time() - t_probe) / (step - probe_start)
                left = cfg.time_budget_s - (time.time() - t_start)
                total_steps = min(cfg.max_steps, step + max(1, int(left / per_step)))
                logger.info("{:.1f} ms/step -> {} steps in the {:.0f}s budget", per_step * 1e3, total_steps,
                            cfg.time_budget_s)
        if step % log_every == 0 or step == total_steps:
            el = time.time() - t_start
            logger.info("step {}/{} loss {:.4f} aux {:.3f} lr {:.2e} gnorm {:.2f} {:.0f} tok/s {:.0f}s", step,
                        total_steps, lm_loss.item(), aux.item(), opt.param_groups[0]["lr"], gnorm.item(),
                        step * B * T / el, el)
        spent_s = time.time() - t_start
        if ckpt_every and (step % ckpt_every == 0 or step == total_steps):
            save_ckpt()
    if use_amp:
        torch.cuda.synchronize()
    model.set_router_observer(None)
    for i, experts in enumerate(dense):
        model.set_experts(i, experts)
    wall = time.time() - t_start
    final = float(np.mean([l for s, l, _ in losses[-10:]]))
    figures = dict(model=cfg.name, params_total=total, params_active=active, train_tokens_available=int(len(ids)),
                   steps=step, tokens_seen=step * B * T, train_wall_s=round(wall, 1),
                   tokens_per_s=round(step * B * T / wall), final_loss=round(final, 4),
                   final_aux_loss=round(float(np.mean([a for *_, a in losses[-10:]])), 4),
                   aux_loss_coef=cfg.aux_loss_coef, lr=cfg.lr, batch_tokens=B * T, context=T,
                   vocab_size=tok.get_vocab_size(), seed=cfg.seed)
    logger.info("trained {} steps, {:.1f}M tokens in {:.0f}s, final loss {:.4f}", step, step * B * T / 1e6, wall, final)
    return dict(model=model, tokenizer=tok, figures=figures, losses=losses)


def evaluate(model, tok, label: str, device: str, max_eval_bytes: int | None = None,
             gen_tokens: int = 48) -> tuple[list[dict], list[dict]]:
    """Perplexity on eval + eval_prose, routing spread on calib, greedy samples: (metric rows, sample rows)."""
    model.eval()
    mc = model.config
    ctx, rows = mc.max_position_embeddings, []
    for name in ("eval", "eval_prose"):
        text = corpus.load_slice(name)[:max_eval_bytes]
        r = evaluate_text(model, tok, text, ctx, device)
        rows.append(dict(kind="eval", model=label, slice=name, **r))
        logger.info("{}: ppl {:.3f} ({:.3f} bits/byte over {} tokens)", name, r["ppl"], r["bits_per_byte"], r["tokens"])
    masses = {}
    for name in ("calib", "eval_prose"):
        stats = RouterStats(model, mc.num_hidden_layers, mc.num_experts, with_loss=False)
        r = evaluate_text(model, tok, corpus.load_slice(name)[:max_eval_bytes], ctx, device, observer=stats)
        masses[name] = stats.mass
        if name == "calib":
            rows.append(dict(kind="eval", model=label, slice=name, **r))
    for row in routing_summary(masses["calib"]):
        p = masses["calib"][row["layer"]] / masses["calib"][row["layer"]].sum()
        q = masses["eval_prose"][row["layer"]] / masses["eval_prose"][row["layer"]].sum()
        row["tv_distance_calib_vs_prose"] = float(0.5 * (p - q).abs().sum())  # domain specialisation
        rows.append(dict(kind="routing", model=label, slice="calib", **row))
        logger.info("routing layer {}: max/min {:.1f}, entropy {:.3f} of uniform, top-quarter {:.3f}, "
                    "TV(calib, prose) {:.3f}", row["layer"], row["max_over_min"], row["entropy_frac_of_uniform"],
                    row["top_quarter_mass_frac"], row["tv_distance_calib_vs_prose"])
    samples = []
    for prompt in PROMPTS:
        out = greedy(model, tok, prompt, gen_tokens, device)
        lines = [line for line in out.splitlines() if line.strip()]
        # greedy decoding of a 5.6M-parameter model falls into loops; this says how much of a sample repeats
        samples.append(dict(kind="sample", model=label, prompt=prompt, greedy_output=out, gen_tokens=gen_tokens,
                            distinct_line_frac=len(set(lines)) / max(1, len(lines))))
        logger.info("prompt {!r} -> {!r}", prompt, out)
    return rows, samples


# ------------------------------------------------------------------------------------------ CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    """`pagedweight train`: train a named config, write an HF dir and a result JSON."""
    p = subparsers.add_parser("train", help="train the bundled tokenizer + Qwen2-MoE model on the Python corpus",
                              description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny",
                   help="named model and training settings (CONFIGS in pagedweight/train.py; tiny: the bundled model)")
    p.add_argument("--out", type=Path, default=None, help="HF model directory to write (omit: do not write one)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/train"),
                   help="tokenizer, token cache, checkpoints and log (reused by --resume)")
    p.add_argument("--results-dir", type=Path, default=None, help="result JSON folder ($OUT or benchmarks/results)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to train on, e.g. cuda, cpu")
    p.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    p.add_argument("--ckpt-every", type=int, default=500, help="checkpoint period in steps (0: never)")
    p.add_argument("--max-steps", type=int, default=None, help="override the config's step cap")
    p.add_argument("--time-budget-s", type=float, default=None, help="override the config's training time budget")
    p.add_argument("--max-eval-bytes", type=int, default=None, help="evaluate on a prefix of each slice")
    p.add_argument("--no-site-packages", action="store_true", help="stdlib only")
    p.add_argument("--seed", type=int, default=None,
                   help="override the config's seed (weights, data order, sampling)")
    p.add_argument("--eval-only", type=Path, default=None, metavar="MODEL_DIR",
                   help="no training: evaluate an HF dir (its tokenizer.json) and write train-eval-<machine>.json")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Train, evaluate, write the HF dir (--out) and the result JSON; returns the exit status."""
    cfg = CONFIGS[args.config]
    over = {k: v for k, v in dict(max_steps=args.max_steps, time_budget_s=args.time_budget_s, seed=args.seed).items()
            if v is not None}
    if args.no_site_packages:
        over["site_packages"] = False
    cfg = dataclasses.replace(cfg, **over)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    sink = logger.add(args.work_dir / f"train-{cfg.name}.log", level="INFO")
    try:
        if args.device == "cpu":
            torch.set_num_threads(min(torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", "2"))))
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
        if args.eval_only is not None:
            return _eval_only(args)
        logger.info("config {}", dataclasses.asdict(cfg))
        res = train(cfg, args.work_dir, args.device, args.resume, ckpt_every=args.ckpt_every)
        model, tok = res["model"], res["tokenizer"]
        model.to(torch.bfloat16).to(torch.float32)  # evaluate exactly the weights the bf16 checkpoint stores
        t0 = time.time()
        rows, samples = evaluate(model, tok, cfg.name, args.device, args.max_eval_bytes)
        res["figures"]["eval_wall_s"] = round(time.time() - t0, 1)
        if args.out is not None:
            from pagedweight.checkpoint import save_hf

            save_hf(model.to("cpu", torch.bfloat16), args.out, tokenizer_json=str(data_cache_paths(cfg, args.work_dir)[0]))
            logger.info("wrote {}", args.out)
        from benchmarks.common import write_result

        figures = dict(kind="train", **res["figures"])
        bench = "train" if cfg.name == "tiny" else f"train-{cfg.name}"
        path = write_result(bench, [figures] + rows + samples, command=" ".join(["pagedweight"] + sys.argv[1:]),
                            out_dir=args.results_dir,
                            extra=dict(config=dataclasses.asdict(cfg), loss_curve=res["losses"][::5]))
        logger.info("wrote {}", path)
    finally:
        logger.remove(sink)
    return 0


def _eval_only(args: argparse.Namespace) -> int:
    """Re-evaluate a saved HF dir (e.g. the bundled model on another machine) into one result JSON."""
    from tokenizers import Tokenizer

    from benchmarks.common import write_result
    from pagedweight.models import load_model

    model = load_model(args.eval_only, dtype=torch.float32, device=args.device)
    tok = Tokenizer.from_file(str(Path(args.eval_only) / "tokenizer.json"))
    t0 = time.time()
    rows, samples = evaluate(model, tok, Path(args.eval_only).name, args.device, args.max_eval_bytes)
    rows.insert(0, dict(kind="eval_run", model=Path(args.eval_only).name, eval_wall_s=round(time.time() - t0, 1)))
    path = write_result("train-eval", rows + samples, command=" ".join(["pagedweight"] + sys.argv[1:]),
                        out_dir=args.results_dir)
    logger.info("wrote {}", path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedweight")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
