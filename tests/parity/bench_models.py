"""Writes the benchmark models of tests/parity/models.py (BENCH: real shapes of small hybrids,
random Q4_K_M-like weights; Gemma 4 26B-A4B's Q4_0):  python tests/parity/bench_models.py OUT_DIR [name ...]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCH, BENCH_QTYPES, BENCH_VOCAB, q4_k_m, write  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:] or BENCH:
        path = out / f"{name}.gguf"
        if not path.exists():
            pick = BENCH_QTYPES.get(name, q4_k_m)
            write(path, name, n_vocab=BENCH_VOCAB[name], qtypes=pick(BENCH[name][1]["block_count"]))
        print(path)
