"""A table read only by row (core.weights.RowTable: Gemma 4's per_layer_token_embd) stays in the file on
the CPU backend: nothing packed at load, the rows a step asks for read and unpacked then, equal to the
reference's rows."""
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends import get_backend
from hearthlm.backends.random_blocks import random_blocks
from hearthlm.backends.reference import dequantize
from hearthlm.core.graph import Graph, Op
from hearthlm.core.weights import QWeight, RowTable


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_0, T.Q8_0, T.Q6_K, T.Q4_K])
def test_rows_read_from_the_file_equal_the_reference(qtype):
    """Mutations: prepare_weight packing a RowTable like any matrix fails the FileRows check; reading
    row ids + 1 out of the file fails the values."""
    rng = np.random.default_rng(0)
    n_rows, n_cols = 40, 512
    if qtype in (T.F32, T.F16):
        raw = rng.standard_normal((n_rows, n_cols)).astype(np.float32 if qtype == T.F32 else np.float16)
        raw = raw.view(np.uint8).reshape(n_rows, -1)
    else:
        raw = random_blocks(qtype, n_rows, n_cols, rng)
    raw.setflags(write=False)  # as the file's mmap
    table = RowTable("per_layer_token_embd.weight", int(qtype), (n_rows, n_cols), raw)
    cpu = get_backend("cpu")
    p = cpu.prepare_weight(table)
    assert type(p).__name__ == "FileRows" and cpu.export_weight(p) is None  # not packed, not cached
    g = Graph()
    ids = g.input("ids", (5,))
    node = g.get_rows(g.weight(table), ids, "rows")
    want = dequantize(QWeight(table.name, table.ggml_type, table.shape, raw))
    pick = np.array([3, 39, 0, 3, 17], np.int32)
    got = cpu.kernels[Op.GET_ROWS](node, p, pick)
    np.testing.assert_array_equal(got, want[pick])
    out = np.empty((5, n_cols), np.float32)  # into a planned buffer
    assert cpu.kernels[Op.GET_ROWS](node, p, pick, out) is out and np.array_equal(out, want[pick])
    assert cpu.kernels[Op.GET_ROWS](node, p, np.zeros(0, np.int32)).shape == (0, n_cols)
    with pytest.raises(IndexError):
        cpu.kernels[Op.GET_ROWS](node, p, np.array([n_rows], np.int32))


def test_an_older_caches_packed_copy_is_not_mapped():
    """A weight cache written before the table was a RowTable holds it packed: the table is still read by row
    (the copy would be paged in as rows are looked up), other weights still come from the cache.
    Mutation: WeightStore.get mapping a RowTable from the cache like any weight fails it."""
    from hearthlm.runtime.weights import WeightStore

    class Cache:  # one entry per name, as weight_cache.WeightCache.load gives them
        def load(self, backend):
            entry = ({"kind": "vector", "_type": 0, "_shape": [4, 32]}, {"v": np.ones((4, 32), np.float32)})
            return {"table": entry, "plain": entry}, "hit"
    raw = np.zeros((4, 128), np.uint8)
    store = WeightStore(get_backend("cpu"), Cache())
    assert type(store.get(RowTable("table", 0, (4, 32), raw))).__name__ == "FileRows"
    assert np.array_equal(store.get(QWeight("plain", 0, (4, 32), raw)), np.ones((4, 32), np.float32))
