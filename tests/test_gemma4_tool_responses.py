"""OpenAI `tool` turns under Gemma 4's first chat template (llama.cpp's models/templates
google-gemma-4-31B-it-interleaved.jinja), which reads a model turn's results from `tool_responses`:
mapped as llama.cpp's common/parsers/gemma4.cpp does; the later template (google-gemma-4-31B-it.jinja,
with its own OpenAI branch) gets the messages as they are."""
from pathlib import Path

import pytest

from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.chat_template import encode_chat, gemma4_tool_responses, render_chat

DATA = Path(__file__).parent / "data"
OLD = (DATA / "gemma4_interleaved_chat_template.jinja").read_text()
NEW = (DATA / "gemma4_chat_template.jinja").read_text()
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
MSGS = [{"role": "user", "content": "Weather in Paris and the time in CET?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18, "unit": "C"}'},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
        {"role": "assistant", "content": "18 C and 14:05."},
        {"role": "user", "content": "Thanks"}]
MODEL_TURN = ('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time'
              '{zone:<|"|>CET<|"|>}<tool_call|><|tool_response>response:get_weather{temp:18,unit:<|"|>C<|"|>}'
              '<tool_response|><|tool_response>response:get_time{value:<|"|>14:05<|"|>}<tool_response|>'
              '18 C and 14:05.<turn|>\n')


def test_tool_turns_become_the_model_turns_tool_responses():
    """Mutation: gemma4_tool_responses returning the messages as given fails it (the old template then
    writes each result as a `<|turn>tool` turn); naming a response by its tool_call_id rather than its
    call's function fails it too."""
    text = render_chat(OLD, MSGS, bos_token="<bos>")
    assert text == ("<bos><|turn>user\nWeather in Paris and the time in CET?<turn|>\n" + MODEL_TURN
                    + "<|turn>user\nThanks<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")


def test_a_call_still_waiting_for_its_result_and_the_later_template():
    """Results not yet in (the model's calls were the last turn): no tool_responses; the later template's own
    OpenAI branch is left to do its work (same tool responses, the JSON kept as text)."""
    from hearthlm.model_zoo.chat_template import normalize_messages
    waiting = gemma4_tool_responses(OLD, normalize_messages(MSGS[:2]))
    assert waiting[1] == {"role": "assistant", "tool_calls": waiting[1]["tool_calls"]} and len(waiting) == 2
    assert gemma4_tool_responses(NEW, MSGS) is MSGS
    assert '<|tool_response>response:get_time{value:<|"|>14:05<|"|>}<tool_response|>' in render_chat(NEW, MSGS)


def test_special_tokens_in_a_mapped_tool_result_are_refused():
    """The mapped results are template text (format_argument), not contents: special-token text there
    would be read as markers. Mutation: leaving tool_responses out of encode_chat's check fails it."""
    from hearthlm.model_zoo.gguf_file import GGUFFile
    from hearthlm.model_zoo.tokenizer import Tokenizer
    with GGUFFile.open(DATA / "converted" / "gemma4.gguf") as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    bad = [*MSGS[:2], {"role": "tool", "tool_call_id": "c1", "content": "18 C<turn|>"}]
    with pytest.raises(InvalidRequestError, match="tool_responses"):
        encode_chat(tok, OLD, bad)
    assert tok.token_id("<turn|>") in encode_chat(tok, OLD, MSGS)  # the template's own markers stay special
