"""Hugging Face checkpoint directories <-> `MoEForCausalLM`, without transformers.

Reads config.json and single or sharded safetensors (with model.safetensors.index.json). Routed experts
are accepted in both layouts transformers uses: per expert (`experts.{e}.gate_proj.weight`, Mixtral's
w1/w3/w2) and fused (`experts.gate_up_proj [E,2F,D]`, `experts.down_proj [E,D,F]`). `save_hf` writes the
per-expert layout, which is what transformers 5.17 `save_pretrained` writes and every version reads.
Every failure is a `CheckpointError` naming the file (and the tensor when there is one).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors import safe_open
from safetensors.torch import save_file

from pagedweight.models import FAMILIES, Family, ModelConfig, MoEForCausalLM, parse_dtype
from pagedweight.models.config import DTYPE_NAMES
from pagedweight.progress import byte_progress

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # the chat template and the special tokens' text (pagedweight.chat)
CHAT_TEMPLATE = "chat_template.jinja"  # the chat template in a file of its own (newer checkpoints)
_EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up|down)$")
# a load this small takes about a second at most: no progress for it (the bundled tiny model, the tests' checkpoints)
PROGRESS_MIN_BYTES = 256 << 20


class CheckpointError(Exception):
    """A checkpoint directory cannot be read as (or written as) a supported model; the message says why."""


# what a checkpoint directory needs from a Hub repository (not its .bin / .pt / .gguf copies of the weights)
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
# Mistral's repositories carry their own format beside the HF one: consolidated*.safetensors, the same weights again
# (~93 GB more for Mixtral-8x7B); vLLM skips them too when it loads the HF format
HUB_SKIPPED = ["consolidated*", "original/*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(name: str | Path) -> Path:
    """A model directory: `name` itself if it is one, else a Hugging Face Hub repository id ("org/model") fetched once
    into the Hub's cache (HF_HOME, shared with transformers and vLLM; HF_HUB_OFFLINE=1 reads the cache alone, HF_TOKEN
    opens gated repositories) with the files HUB_FILES names but HUB_SKIPPED's, as `vllm serve org/model` takes it."""
    path = Path(name)
    if path.is_dir():
        return path
    if not _REPO_ID.match(str(name)) or path.exists():
        raise FileNotFoundError(f"{name}: not a model directory (nor a Hub repository id, e.g. Qwen/Qwen1.5-MoE-A2.7B)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    logger.info("{} is not a directory here: fetching it from the Hugging Face Hub (or its local cache)", name)
    try:
        return Path(snapshot_download(str(name), allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIPPED))
    except LocalEntryNotFoundError as e:  # offline, or the Hub unreachable, and not in the cache
        raise FileNotFoundError(f"{name}: not a model directory, and no cached copy of that Hub repository ({e})") \
            from None
    except HfHubHTTPError as e:  # no such repository or revision, gated without a token, ...
        raise FileNotFoundError(f"{name}: not a model directory here, and the Hugging Face Hub refused it as a "
                                f"repository id ({e})") from None


def model_name(name: str | Path) -> str:
    """The name a model is served under by default: a Hub repository id as given, else its directory's name."""
    return Path(name).resolve().name if Path(name).is_dir() else str(name)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def family_of(raw: dict[str, Any], path: Path) -> Family:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{path}: unknown model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def read_config(model_dir: str | Path) -> ModelConfig:
    """Parse <model_dir>/config.json into a ModelConfig."""
    path = Path(model_dir) / CONFIG
    raw = read_json(path)
    try:
        return family_of(raw, path).from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


class TensorFiles:
    """Name -> shard file over a directory's safetensors; `get` reads one tensor, errors name file and tensor."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self._handles: dict[str, Any] = {}
        self._sizes: dict[str, dict[str, int]] = {}
        if (model_dir / INDEX).is_file():
            index = read_json(model_dir / INDEX)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{model_dir / INDEX}: no 'weight_map'")
            self.where: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
        elif (model_dir / SINGLE).is_file():
            self.where = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            raise CheckpointError(f"{model_dir}: neither {SINGLE} nor {INDEX} found")
        for file in sorted(set(self.where.values())):
            names = set(self._open(file).keys())
            listed = [n for n, f in self.where.items() if f == file]
            absent = [n for n in listed if n not in names]
            if absent:
                raise CheckpointError(f"{model_dir / file}: lacks tensor '{absent[0]}' that {INDEX} places there"
                                      f" ({len(absent)} missing)")

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file not found")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[file] = handle
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def file_of(self, name: str) -> Path:
        return self.dir / self.where[name]

    def nbytes(self, name: str) -> int:
        """Bytes tensor `name` takes in its file, from the file's safetensors header (no tensor data read)."""
        file = self.where[name]
        if file not in self._sizes:
            path = self.dir / file
            try:  # an 8-byte little-endian header length, then the JSON header (safe_open has read it already)
                with open(path, "rb") as f:
                    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
                self._sizes[file] = {k: int(v["data_offsets"][1]) - int(v["data_offsets"][0])
                                     for k, v in header.items() if k != "__metadata__"}
            except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors header ({e})") from None
        return self._sizes[file][name]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._open(self.where[name]).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # a truncated shard fails here, on the first tensor past the end
            raise CheckpointError(f"{self.file_of(name)}: cannot read tensor '{name}' ({e})") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The files a checkpoint's weights load from: model.safetensors, or the index and the shards it names (not
    every *.safetensors of the directory: a Mistral repository's consolidated*.safetensors hold the weights again)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        return [model_dir / INDEX, *(model_dir / f for f in sorted(set(TensorFiles(model_dir).where.values())))]
    return [model_dir / SINGLE]


def hf_names(family: Family, name: str) -> list[str]:
    """Candidate checkpoint names of one of our non-expert parameters (MoE prefix may vary, e.g. Mixtral)."""
    if name.startswith("lm_head."):
        return [name]
    m = re.match(r"^(layers\.\d+\.)mlp\.(.*)$", name)
    if m:
        return [f"model.{m.group(1)}{prefix}.{m.group(2)}" for prefix in family.moe_prefixes]
    return [f"model.{name}"]


def _check_shape(files: TensorFiles, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor if it has the shape config.json implies and a float dtype (fp8 or integer weights are a quantized
    checkpoint's, whose scales a plain cast would drop; float64 casts like the others)."""
    if tensor.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"{files.file_of(name)}: tensor '{name}' is {str(tensor.dtype).removeprefix('torch.')}"
                              ": a quantized checkpoint; convert its bf16/fp16 original")
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{files.file_of(name)}: tensor '{name}' has shape {list(tensor.shape)}, "
                              f"config.json implies {list(shape)}")
    return tensor


def _expert_sources(files: TensorFiles, family: Family, layer: int, kind: str, experts: int
                    ) -> tuple[bool, list[str]]:
    """(fused, names): where gate_up [E,2F,D] or down [E,D,F] is read from, the fused layout's one tensor or the
    per-expert layout's, expert by expert ([gate, up] of each for gate_up)."""
    gate, up, down = family.expert_names
    parts = [gate, up] if kind == "gate_up" else [down]
    tried = []
    for prefix in family.moe_prefixes:
        base = f"model.layers.{layer}.{prefix}.experts"
        fused = f"{base}.{kind}_proj"
        if fused in files:
            return True, [fused]
        first = f"{base}.0.{parts[0]}.weight"
        if first in files:
            names = [f"{base}.{e}.{p}.weight" for e in range(experts) for p in parts]
            for n in names:
                if n not in files:
                    raise CheckpointError(f"{files.dir}: missing tensor '{n}'")
            return False, names
        tried += [fused, first]
    raise CheckpointError(f"{files.dir}: missing tensor '{tried[0]}' (also tried {', '.join(tried[1:])})")


def _read_experts(files: TensorFiles, names: list[str], shape: torch.Size) -> torch.Tensor:
    """gate_up [E,2F,D] or down [E,D,F] stacked from the per-expert tensors `names` (`_expert_sources`' order)."""
    per = len(names) // shape[0]
    part_shape = (shape[1] // per, shape[2])
    return torch.stack([torch.cat([_check_shape(files, n, files.get(n), part_shape)
                                   for n in names[e * per:(e + 1) * per]]) for e in range(shape[0])])


def _sources(files: TensorFiles, family: Family, name: str, shape: torch.Size) -> tuple[bool, list[str]]:
    """(one tensor of that shape?, checkpoint names): where our parameter `name` is read from."""
    m = _EXPERT_PARAM.match(name)
    if m:
        return _expert_sources(files, family, int(m.group(1)), m.group(2), shape[0])
    candidates = hf_names(family, name)
    present = [c for c in candidates if c in files]
    if not present:
        raise CheckpointError(f"{files.dir}: missing tensor '{candidates[0]}'")
    return True, present[:1]


def _read(files: TensorFiles, sources: tuple[bool, list[str]], shape: torch.Size) -> torch.Tensor:
    whole, names = sources
    return _check_shape(files, names[0], files.get(names[0]), shape) if whole else _read_experts(files, names, shape)


def read_parameter(files: TensorFiles, cfg: ModelConfig, name: str, shape: torch.Size) -> torch.Tensor:
    """Our parameter `name` (e.g. `layers.3.mlp.experts.gate_up`) on the CPU at the checkpoint's own dtype,
    shape-checked: one tensor where a whole state dict is not wanted (a conversion's experts, layer by layer)."""
    return _read(files, _sources(files, FAMILIES[cfg.family], name, shape), shape)


def read_state_dict(model_dir: str | Path, cfg: ModelConfig, expected: dict[str, torch.Size],
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    warn_unused: bool = True) -> dict[str, torch.Tensor]:
    """Our-named state dict, every tensor checked against `expected` shapes and cast to dtype on device.
    `warn_unused`: warn about checkpoint tensors `expected` does not name (False where it names a part on purpose).

    Shows progress over the checkpoint bytes it reads (`byte_progress`: a bar on a terminal, log lines off one) when
    they reach PROGRESS_MIN_BYTES, updated once per parameter."""
    files = TensorFiles(Path(model_dir))
    family = FAMILIES[cfg.family]
    plan = {name: _sources(files, family, name, shape) for name, shape in expected.items()
            if not (name == "lm_head.weight" and cfg.tie_word_embeddings)}
    sizes = {name: sum(files.nbytes(n) for n in sources) for name, (_, sources) in plan.items()}
    out: dict[str, torch.Tensor] = {}
    with byte_progress(sum(sizes.values()), "load weights", PROGRESS_MIN_BYTES, model_dir) as bar:
        for name, sources in plan.items():
            out[name] = _read(files, sources, expected[name]).to(device=device, dtype=dtype)
            bar.update(sizes[name])
    if cfg.tie_word_embeddings and "lm_head.weight" in expected:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    used = {n for _, sources in plan.values() for n in sources}
    unused = [n for n in files.where if n not in used]
    if unused and warn_unused:
        logger.warning("{}: {} checkpoint tensors unused, e.g. {}", model_dir, len(unused), unused[:3])
    return out


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu") -> MoEForCausalLM:
    """Build the model on the meta device and assign the checkpoint's tensors (no random-init pass)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    try:
        dtype = parse_dtype(dtype)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    cfg = read_config(model_dir)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = read_state_dict(model_dir, cfg, expected, dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    logger.info("loaded {} ({} layers, {} experts, top-{}) from {} as {}", cfg.family, cfg.num_hidden_layers,
                cfg.num_experts, cfg.top_k, model_dir, DTYPE_NAMES[dtype])
    return model.eval()


def to_hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors in the per-expert layout (tied lm_head left out, as transformers does)."""
    cfg = model.config
    family = FAMILIES[cfg.family]
    gate, up, down = family.expert_names
    prefix = family.moe_prefixes[0]
    f = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _EXPERT_PARAM.match(name)
        if not m:
            out[hf_names(family, name)[0]] = tensor.contiguous()
            continue
        base = f"model.layers.{m.group(1)}.{prefix}.experts"
        for e in range(tensor.shape[0]):
            if m.group(2) == "gate_up":
                out[f"{base}.{e}.{gate}.weight"] = tensor[e, :f].clone()
                out[f"{base}.{e}.{up}.weight"] = tensor[e, f:].clone()
            else:
                out[f"{base}.{e}.{down}.weight"] = tensor[e].clone()
    return out


def save_hf(model: MoEForCausalLM, out_dir: str | Path, tokenizer_json: str | Path | Any = None,
            max_shard_bytes: int | None = None) -> Path:
    """Write a standard HF directory (config.json, generation_config.json, safetensors, tokenizer.json).

    tokenizer_json: a path to copy, or a `tokenizers.Tokenizer` to save. max_shard_bytes: split the weights
    into model-0000i-of-0000n.safetensors shards plus an index when they exceed it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    cfg = model.config
    try:
        hf_config = FAMILIES[cfg.family].to_hf(cfg)
    except ValueError as e:
        raise CheckpointError(f"{out_dir / CONFIG}: {e}") from None
    hf_config["dtype"] = DTYPE_NAMES[dtype]
    (out_dir / CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    eos = list(cfg.eos_token_ids)
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX]:  # a reader would mix them in
        stale.unlink(missing_ok=True)
    tensors = to_hf_state_dict(model)
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out_dir / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(out_dir / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer_json is not None:
        if isinstance(tokenizer_json, (str, Path)):
            shutil.copyfile(tokenizer_json, out_dir / TOKENIZER)
        else:
            tokenizer_json.save(str(out_dir / TOKENIZER))
    logger.info("saved {} ({} tensors, {} file(s)) to {}", cfg.family, len(tensors), len(shards), out_dir)
    return out_dir


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Greedy split of tensor names (in order) into groups of at most max_bytes (one oversized tensor alone)."""
    if max_bytes is None:
        return [list(tensors)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
