"""A loaded model: GGUF weights (mmap'd), the architecture's config and graph builder,
the tokenizer and the chat template. What the engine needs is `build_graph`, `weights`,
`kv_dims`, `n_vocab` and `eog_ids`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from hearthlm.core import layer_memory
from hearthlm.core.errors import HearthError, ModelLoadError
from hearthlm.core.graph import Graph
from hearthlm.core.layer_memory import LayerMemory
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.adapters import AdapterSet, lora_hook
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.model_zoo.models import get_architecture
from hearthlm.model_zoo.tensors import Weights
from hearthlm.model_zoo.tokenizer import Tokenizer
from hearthlm.runtime.batch import BatchShape, one_token

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(eq=False)
class Model:
    path: str
    file: GGUFFile
    arch_name: str
    arch: ModuleType
    config: Any
    weights: dict[str, QWeight]
    tokenizer: Tokenizer
    chat_template: str | None
    n_vocab: int
    _views: dict = field(default_factory=dict, repr=False)
    adapters: AdapterSet = field(default_factory=AdapterSet)  # LoRA adapters, chosen per request

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata

    @property
    def layer_memory(self) -> list[LayerMemory]:
        """Per layer, what it keeps between steps (the architecture's declaration)."""
        return self.config.layer_memory()

    @property
    def kv_dims(self) -> list[tuple[int, int]]:
        return layer_memory.kv_dims(self.layer_memory)

    @property
    def state_dims(self) -> list[dict[str, tuple[int, ...]]]:
        return layer_memory.state_dims(self.layer_memory)

    @property
    def causal(self) -> bool:
        """False for an encoder: no generation; each input runs whole, attending both ways."""
        return self.config.CAUSAL

    @property
    def n_embd_inp(self) -> int:
        """The width of an image's rows the graphs take (n_embd, or wider: Qwen3-VL's deepstack)."""
        return self.config.n_embd_inp

    @property
    def n_pos(self) -> int:
        """Position components per token the graphs take (the "rope_pos" input): M-RoPE's 4, else 1."""
        return self.config.rope.n_pos

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.tokenizer.eog_ids

    def build_graph(self, shape: BatchShape) -> Graph:
        """The architecture's forward pass for this batch shape; its logits are the first output."""
        g = Graph()
        if shape.lora:  # the live adapters' products on every weight they adapt; a step without: today's graph
            live = self.adapters.live  # one gone since (unloaded, used by no request) adapts nothing
            g.lora_hook = lora_hook([live.get(k) for k in shape.lora], shape.n_tokens)
        w = Weights(g, self.weights, self.n_vocab, where=self.path, arch=self.arch_name, views=self._views)
        g.outputs.insert(0, self.arch.build(self.config, g, w, shape))
        return g

    def set_context(self, n_ctx: int) -> None:
        """The context each sequence may reach: LongRoPE picks its factors by it."""
        self.config = dataclasses.replace(self.config, rope=self.config.rope.for_context(n_ctx))

    def close(self) -> None:
        self.file.close()


def load_model(path) -> Model:
    """Open and validate a GGUF model; raises a ModelLoadError subclass naming the problem."""
    f = GGUFFile.open(path)
    try:
        md = f.metadata
        arch_name = f.architecture
        arch = get_architecture(arch_name)
        try:
            config = arch.Config.from_gguf(md, arch_name)
        except (ModelLoadError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{path}: bad {arch_name} hyperparameters in metadata: {e}") from e
        weights = {t.name: QWeight(t.name, int(t.ggml_type), tuple(t.shape), t.raw()) for t in f.tensors.values()}
        out = weights.get("output.weight") or weights.get("token_embd.weight")
        if out is None or len(out.shape) != 2:
            raise ModelLoadError(f"{path}: no 2-D output.weight or token_embd.weight tensor")
        if config.n_layer > len(weights):  # every layer has tensors: refuse before a spec is built per layer
            raise ModelLoadError(f"{path}: block_count {config.n_layer} is more than the {len(weights)} tensors in the file")
        try:
            config = dataclasses.replace(config, rope=config.rope.bind(weights))
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        try:
            tokenizer = Tokenizer.from_gguf_metadata(md)
        except (KeyError, TypeError, ValueError, IndexError) as e:  # metadata of the wrong shape
            raise ModelLoadError(f"{path}: bad tokenizer metadata: {type(e).__name__}: {e}") from e
        if tokenizer.vocab_size > out.shape[0]:  # its last ids would have no embedding row
            raise ModelLoadError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but {out.name} has "
                                 f"{out.shape[0]} rows")
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):  # e.g. an array: no truth value
            raise ModelLoadError(f"{path}: GGUF metadata tokenizer.chat_template is a {type(template).__name__}, not a string")
        model = Model(str(path), f, arch_name, arch, config, weights, tokenizer,
                      template or default_chat_template(arch_name), n_vocab=out.shape[0])
        _check_graph(model)
        return model
    except BaseException:
        f.close()
        raise


def default_chat_template(arch_name: str) -> str | None:
    """The architecture's official template, for GGUFs that ship none (Gemma 3's often don't)."""
    path = TEMPLATES / f"{arch_name}.jinja"
    return path.read_text() if path.is_file() else None


def _check_graph(model: Model) -> None:
    """Build a one-token graph: every tensor the architecture reads exists with the shape it declares."""
    try:
        model.build_graph(one_token(n_state=2 if any(model.state_dims) else 0))
    except HearthError:
        raise
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"{model.path}: tensor shapes do not fit the {model.arch_name} architecture: {e}") from e
