"""The command line: help text, real runs on a tiny checkpoint, one-line errors on bad input, clean-up on failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from pagedweight.checkpoint import save_hf
from pagedweight.cli import EXIT_BAD_INPUT, main
from pagedweight.generate import generate
from pagedweight.models import ModelConfig, build_model
from pagedweight.sampling import SamplingParams
from pagedweight.tokenizer import TextTokenizer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--model", "--prompt", "--chat", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--dtype",
           "--device"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = ModelConfig(family="olmoe", vocab_size=len(words), hidden_size=32, moe_intermediate_size=16,
                      num_hidden_layers=2, num_experts=4, top_k=2, norm_topk_prob=False, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64, qk_norm="full", bos_token_id=1, eos_token_ids=(2,))
    path = tmp_path_factory.mktemp("tiny")
    save_hf(build_model(cfg, seed=0, std=0.3), path, tokenizer_json=tok)
    return path


def test_help_explains_every_option(capsys):
    from pagedweight.cli import build_parser

    generate_parser = build_parser()._subparsers._group_actions[0].choices["generate"]
    helps = {a.option_strings[-1]: a.help for a in generate_parser._actions if a.dest != "help"}
    assert sorted(helps) == sorted(OPTIONS)
    assert all(h and len(h.split()) >= 5 for h in helps.values()), helps
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(option in text for option in OPTIONS)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "generate" in capsys.readouterr().out


def test_generate_prints_the_greedy_completion(model_dir, capsys):
    rc = main(["generate", "--model", str(model_dir), "--prompt", "w3 w17 w5", "--max-tokens", "6",
               "--dtype", "float32"])
    out = capsys.readouterr()
    assert rc == 0
    tokenizer = TextTokenizer.from_dir(model_dir)
    from pagedweight.models import load_model

    new = generate(load_model(model_dir), [tokenizer.encode("w3 w17 w5")], SamplingParams(max_tokens=6), (2,))[0]
    assert new and out.out == tokenizer.decode(new) + "\n"
    assert "new tokens" in out.err  # loguru log on stderr


def test_chat_renders_the_prompt_as_a_user_message(model_dir, tmp_path, capsys):
    """--chat: the prompt goes through the checkpoint's chat template (tokenizer_config.json) before generating."""
    import json
    import shutil

    chat_dir = tmp_path / "chat"
    shutil.copytree(model_dir, chat_dir)
    template = "w1 {% for m in messages %}w{{ m['content'] | length }} {{ m['content'] }} w60{% endfor %} w61"
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert main(["generate", "--model", str(chat_dir), "--prompt", "w3", "--chat", "--max-tokens", "5",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr()
    tokenizer = TextTokenizer.from_dir(model_dir)
    from pagedweight.models import load_model

    ids = tokenizer.encode("w1 w2 w3 w60 w61", add_special_tokens=False)
    new = generate(load_model(model_dir), [ids], SamplingParams(max_tokens=5), (2,))[0]
    assert new and out.out == tokenizer.decode(new) + "\n" and f"{len(ids)} prompt tokens" in out.err


def test_seeded_sampling_is_repeatable(model_dir, capsys):
    args = ["generate", "--model", str(model_dir), "--prompt", "w9", "--max-tokens", "8", "--temperature", "1.5",
            "--top-p", "0.9", "--top-k", "20", "--seed", "123", "--dtype", "float32"]
    outs = []
    for _ in range(2):
        assert main(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


@pytest.mark.parametrize("extra,reason", [
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--temperature", "-1"], "temperature must be finite and >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--dtype", "int8"], "unsupported dtype 'int8'"),
    (["--device", "bogus"], "--device 'bogus' is not a torch device"),
    (["--prompt", ""], "--prompt must not be empty"),
])
def test_bad_input_one_line_error(model_dir, capsys, extra, reason):
    rc = main(["generate", "--model", str(model_dir), "--prompt", "w1", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert err[-1].startswith("pagedweight generate: error: ") and reason in err[-1]


def test_missing_model_dir_subprocess(tmp_path):
    """The module entry point itself: non-zero exit and exactly one stderr line naming the problem."""
    proc = subprocess.run([sys.executable, "-m", "pagedweight.cli", "generate", "--model", str(tmp_path / "none"),
                           "--prompt", "hi"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT
    assert proc.stderr.strip().splitlines() == [f"pagedweight generate: error: {tmp_path / 'none'}: not a model "
                                                "directory (nor a Hub repository id, e.g. Qwen/Qwen1.5-MoE-A2.7B)"]


@pytest.mark.parametrize("argv,reason", [
    (["convert", "{model}", "{tmp}/out", "--calib", "{tmp}/none.txt"], "--calib {tmp}/none.txt: no such file"),
    (["convert", "{model}", "{tmp}/out", "--calib", "{model}/config.json", "--num-seqs", "0"], "need --num-seqs >= 1 and --seq-len >= 2"),
    (["convert", "{model}", "{tmp}/out", "--calib", "{model}/config.json", "--seq-len", "1"], "need --num-seqs >= 1 and --seq-len >= 2"),
    (["serve", "{model}", "--engine-options", "{{bad"], "--engine-options is not JSON"),
    (["serve", "{model}", "--engine-options", '{{"prefix_retention": 5}}'],
     "--engine-options: unknown engine option(s) ['prefix_retention']"),
    (["serve", "{model}", "--gpu-memory-budget", "0"], "--gpu-memory-budget '0': must be positive"),
    (["run", "--model", "{model}", "--num-prompts", "1", "--device", "bogus"], "device 'bogus'"),
    (["run", "--model", "{model}", "--num-prompts", "1", "--prefix-retention-s", "-1"],
     "--prefix-retention-s -1.0: must be >= 0"),
    (["run", "--model", "{model}", "--num-prompts", "1", "--bits", "0"], "--bits 0: a width of at least 1 bit"),
    (["run", "--model", "{model}", "--num-prompts", "1", "--dense", "--static"], "--dense serves the dense weights"),
    (["run", "--model", "{model}", "--num-prompts", "1", "--summary-json", "{tmp}/none/s.json"],
     "--summary-json {tmp}/none/s.json: no such directory"),
    (["run", "--model", "{model}", "--prompts", "{tmp}/none.txt"], "none.txt"),
])
def test_other_commands_refuse_bad_input_before_working(model_dir, tmp_path, capsys, argv, reason):
    """Refused in one line before anything slow starts (a model load, a conversion, a Ray cluster): convert leaves
    no output directory behind."""
    fill = {"model": str(model_dir), "tmp": str(tmp_path)}
    rc = main([a.format(**fill) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_BAD_INPUT
    assert err[-1].startswith(f"pagedweight {argv[0]}: error: ") and reason.format(**fill) in err[-1], err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def hub_cache(model_dir, tmp_path, monkeypatch) -> str:
    """The tiny model as the Hugging Face Hub's cache holds a downloaded repository (models--org--name with a
    snapshot per revision and refs/main), offline: what a machine that fetched it once has. Returns its id."""
    import shutil

    import huggingface_hub.constants as hub

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--pwtest--tiny-moe"
    shutil.copytree(model_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    return "pwtest/tiny-moe"


def test_hub_repository_ids_are_models_too(model_dir, hub_cache, tmp_path, capsys):
    """A Hub repository id (not a directory here) resolves through the Hub's cache, as `vllm serve org/model` does:
    generate gives the same text as from the directory, `run` reports the id as the model's name, and an id with no
    cached copy offline is one line naming the reason."""
    from pagedweight.checkpoint import resolve_model

    assert (resolve_model(hub_cache) / "config.json").is_file()
    args = ["--prompt", "w3 w17 w5", "--max-tokens", "6", "--dtype", "float32"]
    assert main(["generate", "--model", str(model_dir), *args]) == 0
    local = capsys.readouterr().out
    assert main(["generate", "--model", hub_cache, *args]) == 0
    assert capsys.readouterr().out == local and local.strip()
    summary, prompts = tmp_path / "summary.json", tmp_path / "prompts.txt"
    prompts.write_text("w3 w17 w5\n")
    assert main(["run", "--model", hub_cache, "--dense", "--prompts", str(prompts), "--max-tokens", "2",
                 "--device", "cpu", "--summary-json", str(summary)]) == 0
    import json

    assert json.loads(summary.read_text())["model"] == hub_cache
    capsys.readouterr()
    assert main(["generate", "--model", "pwtest/missing", *args]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagedweight generate: error: pwtest/missing: not a model directory, and no cached copy")


def test_prompt_files_json_lines_and_plain_lines(tmp_path):
    """A line that is a JSON object with a "prompt" is that prompt; code beginning with `{` stays a plain prompt; in
    a .jsonl file a line that is not such an object is refused by file and line."""
    from pagedweight.run import load_prompts

    plain = tmp_path / "p.txt"
    plain.write_text('def f():\n{"prompt": "class A:"}\n\n{ return x; }\n{"text": "hi"}\n')
    assert load_prompts(str(plain), None) == ["def f():", "class A:", "{ return x; }", '{"text": "hi"}']
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a"}\n{"prompt": 5}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a JSON object with a non-empty string"):
        load_prompts(str(lines), None)


def test_serve_help_does_not_print_the_api_key(monkeypatch, capsys):
    """The key may come from $PAGEDWEIGHT_API_KEY; --help shows where it comes from, never the key."""
    monkeypatch.setenv("PAGEDWEIGHT_API_KEY", "sk-secret-123")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "PAGEDWEIGHT_API_KEY" in out and "sk-secret" not in out


def test_serve_refuses_replicas_its_own_cluster_cannot_place(model_dir, monkeypatch, capsys):
    """On the Ray cluster `serve` starts itself, replicas beyond its resources are refused before Serve starts
    (Serve would wait for them forever); a joined cluster may autoscale: a warning, and the deploy goes on."""
    import ray
    from ray import serve

    from pagedweight.actors.serve_cli import replicas_short

    assert replicas_short(4, {"num_gpus": 1.0, "num_cpus": 1.0}, {"GPU": 2.0, "CPU": 16.0}) == ["4 x 1 GPU > 2"]
    assert replicas_short(4, {"num_gpus": 0.5, "num_cpus": 1.0}, {"GPU": 2.0, "CPU": 4.0}) == []
    assert replicas_short(3, {"num_gpus": 0.0, "num_cpus": 1.0}, {"CPU": 2.0}) == ["3 x 1 CPU > 2"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})

    class Started(Exception):
        pass

    def start(**kw):
        raise Started

    monkeypatch.setattr(serve, "start", start)
    from conftest import free_port

    port = str(free_port())  # its own cluster's port must be free here (8000 may not be)
    assert main(["serve", str(model_dir), "--dense", "--num-replicas", "3", "--port", port]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagedweight serve: error: --num-replicas 3: the engine replicas need 3 x 1 CPU > 2")
    ended = []
    monkeypatch.setattr(serve, "shutdown", lambda: ended.append("shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: ended.append(f"delete {name}"))
    monkeypatch.setattr(ray, "nodes", lambda: [{}, {}])
    import pagedweight.actors.page_store_actor as store

    monkeypatch.setattr(store, "page_store_for_node", lambda: pytest.fail("no page store of a joined cluster"))
    with pytest.raises(Started):  # a joined cluster: past the check, into Serve
        main(["serve", str(model_dir), "--dense", "--num-replicas", "3", "--address", "ray://elsewhere:10001"])
    err = capsys.readouterr().err
    assert "3 engine replicas need 3 x 1 CPU > 2: the deploy waits" in err and "must be there too" in err
    assert ended == ["delete pagedweight"]  # not serve.shutdown(): other applications of that cluster stay
    with pytest.raises(Started):  # GPU replicas asked of a cluster whose GPU nodes are at zero: it may scale up
        main(["serve", str(model_dir), "--dense", "--gpus-per-replica", "1", "--address", "ray://elsewhere:10001"])
    assert "1 engine replicas need 1 x 1 GPU > 0: the deploy waits" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--dense", "--gpus-per-replica", "2", "--port", port]) == EXIT_BAD_INPUT


def test_hub_fetch_takes_the_hf_format_alone():
    """Of a Mistral repository's files, the fetch takes the HF format's (config, tokenizer, index and shards) and
    skips Mistral's own consolidated weights (the same weights again) and other formats."""
    from huggingface_hub.utils import filter_repo_objects

    from pagedweight.checkpoint import HUB_FILES, HUB_SKIPPED

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "model.safetensors.index.json", "model-00001-of-00019.safetensors", "model-00019-of-00019.safetensors",
            "consolidated.safetensors", "consolidated.00.pt", "params.json", "original/consolidated.00.pth",
            "pytorch_model-00001-of-00019.bin", "README.md", ".gitattributes"]
    assert list(filter_repo_objects(repo, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIPPED)) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "model.safetensors.index.json", "model-00001-of-00019.safetensors", "model-00019-of-00019.safetensors",
        "params.json"]


# ---------------------------------------------------------------- review: run / generate clean-up and bad input
@pytest.fixture(scope="module")
def ap_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint converted to any precision (a quick calibration): engines over it map a page store."""
    from pagedweight.convert import convert
    from pagedweight.corpus import DATA_DIR

    out = tmp_path_factory.mktemp("tiny-ap") / "tiny-ap"
    convert(model_dir, out, DATA_DIR / "calib.txt", sensitivity="activation", num_seqs=2, seq_len=16, heads_seqs=0,
            device="cpu")
    return out


@pytest.fixture
def default_store(ap_dir) -> Path:
    """The node page store an engine over `ap_dir` writes by default; absent before the test (what an earlier failed
    run left is removed) and removed after it."""
    from pagedweight.apformat import load_ap
    from pagedweight.page_store import PageStore
    from pagedweight.runner import planes_id

    store = Path(f"/dev/shm/pagedweight-{planes_id(load_ap(ap_dir, verify=False))}")
    if store.exists():
        PageStore.destroy(store)
    yield store
    if store.exists():
        PageStore.destroy(store)


def test_run_removes_the_page_store_it_wrote_when_it_fails_or_is_interrupted(ap_dir, default_store, tmp_path,
                                                                               monkeypatch, capsys):
    """The default store (the planes in /dev/shm: RAM, ~54 GB for Mixtral) goes with the run that wrote it also when
    the engine is refused (a budget too small) or the run is interrupted (Ctrl-C): both left it in /dev/shm. An
    interrupted run writes no summary."""
    from pagedweight.engine import LLM

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w17 w5\nw1 w2\n")
    base = ["run", "--model", str(ap_dir), "--prompts", str(prompts), "--max-tokens", "2", "--device", "cpu"]
    assert main([*base, "--gpu-memory-budget", "40KiB"]) == EXIT_BAD_INPUT
    assert "not even one KV block" in capsys.readouterr().err
    assert not default_store.exists()

    def interrupted(self):
        assert default_store.exists()  # written by this run, in use
        raise KeyboardInterrupt

    summary = tmp_path / "summary.json"
    with monkeypatch.context() as m:
        m.setattr(LLM, "step", interrupted)
        assert main([*base, "--summary-json", str(summary)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not default_store.exists() and not summary.exists()
    assert main([*base, "--summary-json", str(summary)]) == 0  # and a whole run still removes it
    assert not default_store.exists() and json.loads(summary.read_text())["requests"] == 2
    assert main([*base, "--keep-page-store"]) == 0  # unless asked to keep it
    assert default_store.exists()


def test_generate_removes_the_page_store_it_wrote(ap_dir, default_store, capsys):
    """`generate` over an AP checkpoint maps a page store like `run`: it left the one it wrote in /dev/shm."""
    assert main(["generate", "--model", str(ap_dir), "--prompt", "w3 w17", "--max-tokens", "3",
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip()
    assert not default_store.exists()


def test_summary_json_is_written_whole_or_not_at_all(model_dir, tmp_path, monkeypatch):
    """A write that fails midway (a full disk) leaves the previous summary as it was and no temporary file: the
    summary was truncated and half written in place."""
    import builtins
    import io

    summary = tmp_path / "summary.json"
    summary.write_text('{"old": true}\n')
    real_open = io.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file
        if "w" in mode and Path(name).parent == tmp_path:
            write = f.write

            def half(text):
                write(text[:len(text) // 2])
                f.flush()
                raise OSError(28, "No space left on device")

            f.write = half
        return f

    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w17 w5\n")
    monkeypatch.setattr(io, "open", full_disk_open)
    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(OSError, match="No space"):
        main(["run", "--model", str(model_dir), "--dense", "--prompts", str(prompts), "--max-tokens", "2",
              "--device", "cpu", "--summary-json", str(summary)])
    monkeypatch.undo()
    assert summary.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "summary.json"]
    assert main(["run", "--model", str(model_dir), "--dense", "--prompts", str(prompts), "--max-tokens", "2",
                 "--device", "cpu", "--summary-json", str(summary)]) == 0
    assert json.loads(summary.read_text())["requests"] == 1
    assert summary.stat().st_mode & 0o777 == prompts.stat().st_mode & 0o777  # as any file it writes, not private


def test_run_refuses_unusable_prompt_and_summary_paths(model_dir, tmp_path, capsys):
    """A directory given as --prompts or --summary-json, an empty prompt file: one line and exit 2 before the model
    loads (a directory was a traceback, the summary's only after the whole run; an empty file ran nothing and
    exited 0)."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    base = ["run", "--model", str(model_dir), "--dense", "--device", "cpu"]
    cases = [(["--prompts", str(tmp_path / "adir")], f"--prompts {tmp_path / 'adir'}: not a file"),
             (["--prompts", str(tmp_path / "empty.txt")], f"--prompts {tmp_path / 'empty.txt'}: no prompt in it"),
             (["--prompts", str(tmp_path / "bin.txt")], f"--prompts {tmp_path / 'bin.txt'}: not UTF-8 text"),
             (["--num-prompts", "1", "--summary-json", str(tmp_path / "adir")],
              f"--summary-json {tmp_path / 'adir'}: is a directory")]
    for extra, reason in cases:
        assert main([*base, *extra]) == EXIT_BAD_INPUT, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("pagedweight run: error: ") and reason in err[-1], err


@pytest.mark.parametrize("command", ["run", "serve", "generate", "train"])
def test_every_option_of_a_command_is_explained_once(command, capsys):
    """README: each subcommand's --help explains every option. Defaults are said once (run's said them twice:
    "(default: ...) (default: None)"), and an off switch does not read "(default: True)"."""
    from pagedweight.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    missing = [a.option_strings[-1] for a in sub._actions if a.dest != "help" and a.option_strings and not a.help]
    assert not missing
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: False)" not in text
    formatter = sub._get_formatter()
    twice = [a.dest for a in sub._actions if a.help and formatter._expand_help(a).count("default") > 1]
    assert not twice


def test_serve_refuses_a_port_in_use_before_starting_ray(model_dir, monkeypatch, capsys):
    """On its own cluster `serve` binds the port on this machine: one in use is refused in one line before Ray and
    Serve start (it failed after them, in Serve's proxy, with a 60-line traceback)."""
    import socket

    import ray

    from conftest import free_port

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("Ray started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(model_dir), "--dense", "--port", str(port)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"pagedweight serve: error: --port {port}: 127.0.0.1:{port} is in use")


def test_serve_names_the_exception_a_failed_deploy_ended_with(model_dir, monkeypatch, capsys):
    """An app whose engine replicas fail to start ends in one line naming the exception that stopped the engine, after
    the cluster is shut down. Ray 2.60's error names only the failed deployments ("Deploying application ... failed:
    Failed to update the deployments [...]."); the replica's traceback is in the deployment's status message."""
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentStatus

    import pagedweight.actors.page_store_actor as store
    from conftest import free_port

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    # the messages as Ray 2.60 words them (serve/_private/client.py, application_state.py, deployment_state.py)
    message = "Deploying application pagedweight failed: Failed to update the deployments ['EngineReplica']."
    replica = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
               "initial health check failing. See controller logs for details. Error:\n"
               "\x1b[36mray::ServeReplica:pagedweight:EngineReplica.initialize_and_get_metadata()\x1b[39m (pid=1)\n"
               '  File "replica.py", line 1928, in initialize\n    raise RuntimeError(traceback.format_exc())\n'
               "RuntimeError: Traceback (most recent call last):\n"
               '  File "replica.py", line 1, in initialize\n    self.engine = build()\n'
               "ValueError: gpu_memory_budget 1.0 GiB too small: the dense weights need 1.2 GiB")

    def failed(*a, **kw):
        raise RuntimeError(message)

    class Deployment:
        status, message = DeploymentStatus.DEPLOY_FAILED, replica

    class App:
        deployments = {"EngineReplica": Deployment}

    class Status:
        applications = {"pagedweight": App}

    ended = []
    monkeypatch.setattr(serve, "run", failed)
    monkeypatch.setattr(serve, "status", lambda: Status)
    monkeypatch.setattr(serve, "shutdown", lambda: ended.append("shutdown"))

    class Store:
        class destroy:
            @staticmethod
            def remote():
                ended.append("store")

    monkeypatch.setattr(store, "page_store_for_node", lambda: Store)
    monkeypatch.setattr(ray, "get", lambda ref: None)
    assert main(["serve", str(model_dir), "--dense", "--port", str(free_port())]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pagedweight serve: error: the engine replicas failed to start: ValueError: "
                              "gpu_memory_budget 1.0 GiB too small") and "logs/serve/" in err[-1]
    assert not any("Traceback" in line for line in err) and ended == ["shutdown", "store"]
    from pagedweight.actors.serve_cli import deploy_error

    # a message that carries the traceback itself (a failed build of the app) is read as it is
    built = RuntimeError(f"Deploying application pagedweight failed: Traceback (most recent call last):\n"
                         "  File \"app.py\", line 1\nKeyError: 'model'")
    assert str(deploy_error(built)).startswith("the engine replicas failed to start: KeyError: 'model'")
    # no status to read (the controller gone): the app's own message
    assert "Failed to update the deployments" in str(deploy_error(RuntimeError(message), ""))
    other = RuntimeError("Waiting for application pagedweight to be RUNNING, but application doesn't exist.")
    assert deploy_error(other) is other  # not a deploy failure's message: as it is
