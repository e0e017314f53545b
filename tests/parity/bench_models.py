"""Writes the benchmark models of tests/parity/models.py (BENCH: real shapes of small hybrids,
random Q4_K_M-like weights):  python tests/parity/bench_models.py OUT_DIR [name ...]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCH, BENCH_VOCAB, q4_k_m, write  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:] or BENCH:
        path = out / f"{name}.gguf"
        if not path.exists():
            write(path, name, n_vocab=BENCH_VOCAB[name], qtypes=q4_k_m(BENCH[name][1]["block_count"]))
        print(path)
