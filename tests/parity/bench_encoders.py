"""Writes the embedding benchmark models (tests/parity/encoders.py BENCH: all-MiniLM-L6's and
bge-small's shapes, random weights) in F16 and Q8_0:  python tests/parity/bench_encoders.py OUT_DIR"""
import sys
from pathlib import Path

from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).parent))
from encoders import BENCH, write  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in BENCH:
        for qtype in (T.F16, T.Q8_0):
            path = out / f"{name}-{qtype.name.lower()}.gguf"
            if not path.exists():
                write(path, "", bench=name, qtype=qtype)
            print(path)
