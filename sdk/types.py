"""What generate() returns and stream() yields."""
from __future__ import annotations

from dataclasses import dataclass, field

# (token_id, logprob), most likely first; the sampled token last when it is not among the k
TopLogprobs = list[tuple[int, float]]
# a prompt token: (token_id, its logprob given the tokens before it (None for the first),
# the k most likely tokens there (None for the first, or when k = 0))
PromptLogprob = tuple[int, "float | None", "TopLogprobs | None"]


@dataclass
class Chunk:
    text: str                       # new text since the last chunk (never half a UTF-8 character)
    token_ids: list[int]            # tokens produced since the last chunk
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length" | "tool_calls"
    top_logprobs: list[TopLogprobs] | None = None  # per token in token_ids, if asked for
    prompt_tokens: int | None = None  # on the last chunk: the prompt's length in tokens (for usage)
    tool_calls: list[dict] | None = None  # on the last chunk, when the model called tools
    reasoning: str = ""             # new thinking text (templates that think: it is not in `text`)
    index: int = 0                  # which of the n choices (stream(..., n=k))
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first chunk, if asked for
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended it, if one did


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str              # "stop" (EOS, stop token or stop string) | "length" | "tool_calls"
    #                                 | "max_rounds" (Session.act: still calling tools when its rounds ran out)
    prompt_tokens: int = 0
    top_logprobs: list[TopLogprobs] | None = field(default=None)
    # OpenAI-shaped: [{"id", "type": "function", "function": {"name", "arguments": JSON str}}];
    # `text` is then the message content less the calls
    tool_calls: list[dict] | None = None
    reasoning: str = ""             # the thinking, apart from `text` (templates that think)
    prompt_logprobs: list[PromptLogprob] | None = None  # generate(..., prompt_logprobs=k)
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    messages: list[dict] | None = None  # Session.act: the whole exchange (input, calls, tool results, answer)
