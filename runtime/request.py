"""A request as the engine sees it, and its kind (what the engine does with it)."""
from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from hearthlm.core.errors import InvalidRequestError
from hearthlm.runtime.sampling import SamplingParams, TokenCounts, penalized
from hearthlm.runtime.speculative import NgramDrafter

_ids = itertools.count(1)

# on_token(token_id, top_logprobs | None); on_finish(reason, error | None); called on the engine thread
OnToken = Callable[[int, Optional[list[tuple[int, float]]]], None]
OnFinish = Callable[[str, Optional[BaseException]], None]


class Kind(str, enum.Enum):
    """What a request wants from the engine, set where the request is made."""
    GENERATE = "generate"  # tokens sampled after the prompt (and the prompt's log-probs, if asked)
    SCORE = "score"        # the prompt's log-probs (prompt_logprobs), nothing generated
    PREFILL = "prefill"    # the prompt's KV computed and persisted (Session.cache_prefix), nothing generated
    EMBED = "embed"        # the final hidden states pooled (`pooling`: mean, cls or last); no KV kept
    RANK = "rank"          # a reranker's classification head at its scored token; no KV kept
    DRAFT = "draft"        # a draft model's view of a target's request: its last row's logits, unsampled

    @property
    def pools(self) -> bool:
        """Embeds or ranks: no output after the prompt, none of its KV kept for later prompts."""
        return self in (Kind.EMBED, Kind.RANK)


EMBED_POOLINGS = ("mean", "cls", "last")


@dataclass(eq=False)
class Media:
    """An image in a request's prompt: its rows (the vision tower's output, runtime.vision) take
    the places of prompt tokens start .. start + n, whose ids are placeholders (placeholder_ids)."""
    start: int
    n: int
    key: bytes                    # the image's identity: decoded pixels, preprocessing, mmproj
    pixels: np.ndarray | None     # preprocessed (3, H, W) float32, what the tower takes
    bidirectional: bool = False   # its rows attend to each other both ways (computed in one chunk)
    rows: np.ndarray | None = None  # (n, n_embd), once encoded
    # M-RoPE (a text model whose RoPE takes position components): each row's (t, h, w) past the
    # image's first position (grid_positions), and the positions the image takes, n_pos, which
    # later tokens are shifted by (mtmd's n_pos: max(nx, ny), not n). None: positions as tokens.
    positions: np.ndarray | None = None
    n_pos: int = 0

    @property
    def end(self) -> int:
        return self.start + self.n


def grid_positions(nx: int, ny: int) -> tuple[np.ndarray, int]:
    """An image of ny rows of nx tokens (row-major) under M-RoPE (mtmd_image_tokens_get_decoder_pos):
    each row's (t, h, w) offsets (0, y, x), and the positions it takes, max(nx, ny)."""
    y, x = np.divmod(np.arange(nx * ny, dtype=np.int32), nx)
    return np.stack([np.zeros_like(x), y, x], axis=1), max(nx, ny)


def rope_positions(media: list[Media], lo: int, hi: int, n_pos: int = 4) -> np.ndarray:
    """(hi - lo, n_pos) int32: the M-RoPE position components (t, h, w, e) of a request's tokens
    lo .. hi (llama.cpp's pos for an M-RoPE batch): text at (p, p, p, 0) where p is the token's
    index shifted by what the images before it take less their rows; an image's rows at its first
    position p0 plus their offsets (p0 + t, p0 + h, p0 + w, 0)."""
    idx = np.arange(lo, hi, dtype=np.int64)
    p, text = idx.copy(), np.ones(hi - lo, bool)
    out = np.zeros((hi - lo, n_pos), np.int32)
    for m in media:  # in prompt order
        if m.positions is None:
            continue
        inside = (idx >= m.start) & (idx < m.end)
        out[inside, :3] = p[inside, None] - (idx[inside, None] - m.start) + m.positions[idx[inside] - m.start]
        text &= ~inside
        p[idx >= m.end] += m.n_pos - m.n
    out[text, :3] = p[text, None]
    return out


def placeholder_ids(key: bytes, n: int) -> list[int]:
    """Prompt ids for an image's n rows: negative (no token has them), one per offset, derived
    from the image's identity, so prefix-cache block hashes (and persisted prompts) carry the
    image and its offset, as vLLM's extra keys do."""
    return [-1 - (int.from_bytes(hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=4).digest(), "little")
                  & 0x3FFFFFFF) for i in range(n)]


def chunk_past_media(media: list[Media], lo: int, take: int) -> int:
    """A chunk of `take` tokens from lo, cut or stretched so that it never reaches an image not
    encoded yet (it waits), nor ends inside an image that attends both ways: ended before it
    where it starts later, else carried to its end."""
    hi = lo + take
    for m in media:
        if m.rows is None and m.start < hi and lo < m.end:
            return max(m.start - lo, 0)
        if m.bidirectional and m.start < hi < m.end:
            return m.start - lo if m.start > lo else m.end - lo
    return take


@dataclass
class ThinkBudget:
    """reasoning_budget: after `budget` tokens of thinking the closing marker (`close`, token ids)
    is fed as the next tokens, unsampled, and the answer begins. The thinking is told by text (a
    marker's tokens depend on what comes before it): it starts after `start` (or at once, where
    the prompt opened it) and ends at `end`; `piece` spells a token."""
    budget: int
    start: bytes
    end: bytes
    close: list[int]
    piece: Callable[[int], bytes]
    thinking: bool = False
    done: bool = False
    n: int = 0
    tail: bytes = b""

    def after(self, tok: int) -> list[int]:
        """The tokens to force after `tok`, if any."""
        if self.done:
            return []
        self.tail = (self.tail + self.piece(tok))[-max(len(self.start), len(self.end)):]
        if not self.thinking:  # the marker that opens it counts no thinking token
            self.thinking = self.tail.endswith(self.start)
            over = self.thinking and self.budget == 0
        elif self.end in self.tail:  # the model closed it itself
            self.done = True
            return []
        else:
            self.n += 1
            over = self.n >= self.budget
        self.done = over
        return list(self.close) if over else []


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    on_token: OnToken
    on_finish: OnFinish
    kind: Kind = field(kw_only=True)
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = 0.0
    tokens: list[int] = field(default_factory=list)   # prompt + generated so far
    n_computed: int = 0                              # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)   # KV blocks, in position order
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks registered so far
    state_slot: int | None = None                    # recurrent-state slot (hybrid models), while admitted
    # tokens computed -> a state slot holding the state after them: where a speculating request's
    # state can be rolled back to (SequenceMemory.reserve_rollback / rollback)
    state_snaps: dict[int, int] = field(default_factory=dict)
    n_generated: int = 0
    n_preempted: int = 0
    first_token_at: float | None = None
    rng: np.random.Generator | None = None
    # Kind.EMBED's pooling ("mean", "cls" or "last"; Kind.RANK's is "rank"); when it finishes,
    # `pooled` holds the pooled final hidden state (or the rank head's output)
    pooling: str | None = None
    pooled: np.ndarray | None = None  # while running: the sum of rows (mean), the first (cls) or the last
    matcher: Any = None  # runtime.constraint.Matcher: the grammar the output must follow
    counts: TokenCounts | None = None  # of `tokens`, for the penalties (kept only where they apply)
    # prompt log-probs (echo, scoring): every prompt row's logits are computed, and prompt_lps[i]
    # holds (logprob of prompt token i+1, its k most likely alternatives or None); k = prompt_logprobs
    prompt_logprobs: int | None = None
    prompt_lps: list = field(default_factory=list)
    think: ThinkBudget | None = None  # reasoning_budget, where one is set
    spec: Any = None  # runtime.speculative.NgramDrafter, where the request speculates
    draft: list[int] = field(default_factory=list)  # this step's draft tokens, computed after `tokens`
    persisted: int = 0  # Kind.PREFILL: the tokens it wrote to the prompt cache
    media: list[Media] = field(default_factory=list)  # images in the prompt, in order
    lora: tuple[tuple[str, float], ...] = ()  # LoRA adapters (key, scale) by key; (): the base model

    def __post_init__(self) -> None:
        self.kind = Kind(self.kind)
        if self.kind is Kind.RANK:
            self.pooling = "rank"
        elif not (self.pooling in EMBED_POOLINGS if self.kind is Kind.EMBED else self.pooling is None):
            raise InvalidRequestError(f"a {self.kind.value} request with pooling={self.pooling!r}: an embedding "
                                      f"pools by one of {', '.join(EMBED_POOLINGS)}, other kinds by none")
        if self.kind is Kind.SCORE and self.prompt_logprobs is None:
            raise InvalidRequestError("a score request needs prompt_logprobs")
        if self.kind is not Kind.GENERATE and self.max_tokens:
            raise InvalidRequestError(f"a {self.kind.value} request generates nothing: max_tokens must be 0")
        self.tokens = list(self.prompt)
        self.rng = np.random.default_rng(self.params.seed)
        if penalized(self.params):
            self.counts = TokenCounts(self.tokens)
        if self.params.speculative == "ngram":
            self.spec = NgramDrafter()

    def in_media(self, i: int) -> bool:
        """Whether prompt position i is an image's (a placeholder id)."""
        return any(m.start <= i < m.end for m in self.media)

    def append(self, t: int) -> None:
        """A generated token."""
        self.tokens.append(t)
        if self.counts is not None:
            self.counts.add(t)

    @property
    def n_total(self) -> int:
        """Tokens to have computed at the end of this step's work: the tokens and any draft."""
        return len(self.tokens) + len(self.draft)

    @property
    def n_wanted(self) -> int:
        return self.n_total - self.n_computed


def check_media(req: Request, vision: bool, mrope: bool = False) -> None:
    """A request's images: for a session with a vision tower, in kinds that take them, without a
    draft model, in order inside the prompt; for an M-RoPE text model, each with its rows' positions."""
    if not vision:
        raise InvalidRequestError("this session has no vision tower (mmproj): it cannot take images")
    if req.kind not in (Kind.GENERATE, Kind.SCORE, Kind.PREFILL):
        raise InvalidRequestError(f"a {req.kind.value} request cannot take images")
    if req.spec is not None and not isinstance(req.spec, NgramDrafter):
        raise InvalidRequestError("a draft model cannot see images: pass speculative='off' (or 'ngram') with images")
    end = 0
    for m in req.media:
        if m.start < end or m.end > len(req.prompt) or m.n <= 0 or m.pixels is None and m.rows is None:
            raise InvalidRequestError(f"an image's rows {m.start}..{m.end} overlap another's or leave the prompt")
        if mrope and (m.positions is None or m.positions.shape != (m.n, 3) or m.n_pos <= 0):
            raise InvalidRequestError(f"the image at {m.start}..{m.end} has no grid positions (n, 3) and n_pos, "
                                      "which this model's M-RoPE places its rows by (request.grid_positions)")
        end = m.end
