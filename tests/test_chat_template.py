"""Chat templates (pagedweight.chat, TextTokenizer.apply_chat_template, LLM.chat) against transformers'
apply_chat_template on the bundled tokenizer, with templates of our own that use what real checkpoints' templates
use: special tokens, trim, loop controls, namespaces, tojson and raise_exception."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.chat import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError
from pagedweight.tokenizer import TextTokenizer

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "pw-tiny-moe"
EOS = "<|endoftext|>"
# a ChatML-style template: a default system turn, turns between markers, content trimmed
TURNS = ("{%- for message in messages %}\n"
         "{%- if loop.first and message['role'] != 'system' %}<|turn|>system\nYou help.<|end|>\n{% endif %}\n"
         "<|turn|>{{ message['role'] }}\n{{ message['content'] | trim }}<|end|>\n"
         "{% endfor %}\n"
         "{%- if add_generation_prompt %}<|turn|>assistant\n{% endif %}")
# roles must alternate (raise_exception), system turns skipped (continue), a counter (namespace), JSON content
STRICT = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
          "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
          "{% if (m['role'] == 'user') != (ns.n % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          "{% set ns.n = ns.n + 1 %}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}[ASSISTANT]{% if thinking %} <think>{% endif %}{% endif %}")


def hf_tokenizer(template: str) -> transformers.PreTrainedTokenizerFast:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED / "tokenizer.json"), bos_token=EOS,
                                               eos_token=EOS)
    tok.chat_template = template
    return tok


def hf_ids(tok, messages: list[dict], **kw) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def model_dir_with(tmp_path: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(BUNDLED / name, d / name)
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
alternating = st.lists(st.tuples(text, text), min_size=1, max_size=3).map(
    lambda pairs: [{"role": r, "content": c} for u, a in pairs for r, c in (("user", u), ("assistant", a))][:-1])


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.just([]), st.lists(st.builds(lambda c: {"role": "system", "content": c}, text), max_size=1)),
       alternating)
def test_renders_as_transformers_does(system, turns):
    """The same text as transformers for random contents (whitespace, newlines, markup, any script), with the
    special tokens and the generation cue."""
    messages = system + turns
    for template in (TURNS, STRICT, DEFAULT_TEMPLATE):
        ours = ChatTemplate(template, {"bos_token": EOS, "eos_token": EOS}).render(messages)
        assert ours == hf_tokenizer(template).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_default_template_is_the_role_prefixed_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert ChatTemplate(None).render(messages) == "system: Be brief.\nuser: Hi\nthere\nassistant:"


def test_checkpoint_template_tokens_match_transformers(tmp_path):
    """A checkpoint's template (tokenizer_config.json) gives the ids transformers gives: rendered, then tokenized
    without the tokenizer's own special tokens; extra variables reach the template."""
    tok = TextTokenizer.from_dir(model_dir_with(tmp_path, {"chat_template": STRICT, "bos_token": EOS,
                                                           "eos_token": {"content": EOS, "special": True}}))
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "Reverse <a> list."},
                {"role": "assistant", "content": "l[::-1]"}, {"role": "user", "content": "Sort it."}]
    hf = hf_tokenizer(STRICT)
    assert tok.apply_chat_template(messages) == hf_ids(hf, messages)
    assert tok.apply_chat_template(messages, thinking=True) == hf_ids(hf, messages, thinking=True)
    assert tok.apply_chat_template(messages)[0] == tok.encode(EOS, add_special_tokens=False)[0]  # bos_token, once
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.apply_chat_template(messages[:2] + messages[1:2])


def test_template_sources(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates gives "default"; no template:
    the role-prefixed default, tokenized with the tokenizer's special tokens."""
    (tmp_path / "a").mkdir()
    named = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": TURNS}]}
    assert TextTokenizer.from_dir(model_dir_with(tmp_path / "a", named)).chat_template.source == TURNS
    (tmp_path / "b").mkdir()
    both = model_dir_with(tmp_path / "b", {"chat_template": TURNS}, jinja=STRICT)
    assert TextTokenizer.from_dir(both).chat_template.source == STRICT
    plain = TextTokenizer.from_dir(BUNDLED)
    assert plain.chat_template.source is None and plain.chat_template.add_special_tokens
    for broken in ("{{ messages[0]['content'] | nosuchfilter }}", "{% for m in messages %}", "{{ messages[0] + 1 }}"):
        with pytest.raises(ChatTemplateError, match="chat template failed"):
            ChatTemplate(broken).render([{"role": "user", "content": "x"}])


def test_llm_chat_generates_from_the_rendered_prompt(tmp_path):
    """LLM.chat renders each conversation with the checkpoint's template and generates from those ids."""
    from pagedweight.engine import LLM
    from pagedweight.sampling import SamplingParams

    d = model_dir_with(tmp_path, {"chat_template": TURNS})
    shutil.copy(BUNDLED / "model.safetensors", d / "model.safetensors")
    llm = LLM(d, block_size=4)
    convs = [[{"role": "user", "content": "A function that adds two numbers."}],
             [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Reverse a list."}]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    hf = hf_tokenizer(TURNS)
    for out, ref, conv in zip(outs, llm.generate([hf_ids(hf, c) for c in convs], params, use_tqdm=False), convs):
        assert out.prompt_token_ids == hf_ids(hf, conv) and out.token_ids == ref.token_ids
    assert llm.chat(convs[0], params, use_tqdm=False)[0].token_ids == outs[0].token_ids  # one conversation


def test_tools_none_and_the_generation_tag_render_as_transformers_does():
    """transformers passes tools and documents as None (a template's `tools is not none` is false without tools;
    undefined, it held, and `tools | tojson` failed every request) and takes `{% generation %}` blocks (a template
    using them failed to compile here)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    templates = ["{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}"
                 "{% if documents is not none %}DOCS{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                 "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}</a>"
                 "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"]
    for template in templates:
        ours = ChatTemplate(template, {"bos_token": EOS, "eos_token": EOS}).render(messages)
        assert ours == hf_tokenizer(template).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
