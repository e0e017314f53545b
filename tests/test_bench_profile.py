"""`hearthlm bench --profile`: a decode step's time by op kind, and the weight bytes those kernels
read with the rate they read them at and the roofline fraction (issue #40's profile)."""
from __future__ import annotations

import pytest
from gguf import GGUFReader

from hearthlm.bench.profile import print_profile, run_profile
from hearthlm.cli import build_parser


def test_profile_counts_every_weight_a_decode_token_reads_once(smollm2_path, capsys):
    """SmolLM2's step reads each block weight and the (tied) output projection once: the file's
    bytes but the token embedding's, give or take the packed layout's scales; the embedding's
    lookup reads a row, and is not counted. Mutations: counting the lookup's whole table (+30 MB),
    or a roofline in GB against bytes/s (0.00), each fail it."""
    a = build_parser().parse_args(["bench", "--model", str(smollm2_path), "--profile", "--concurrency", "1",
                                   "--decode-tokens", "8", "--threads", "1"])
    (row,) = run_profile(a)
    r = GGUFReader(smollm2_path)
    file_mb = sum(t.n_bytes for t in r.tensors if t.name != "token_embd.weight") / 1e6
    out_mb = next(t.n_bytes for t in r.tensors if t.name == "token_embd.weight") / 1e6  # tied: the output's
    total = sum(row["weight_mb"].values())
    assert abs(total - (file_mb + out_mb)) / (file_mb + out_mb) < 0.05, (total, file_mb, out_mb)
    assert "get_rows" not in row["weight_mb"]
    assert set(row["weight_mb"]) <= {"mul_mat", "mul_mat_add", "ffn_glu", "rms_norm_mul", "rms_norm_mul_add"}
    roof = total * 1e6 * row["tok_s"] / (row["read_gb_s"] * 1e9)
    assert 0.01 < row["roofline"] == pytest.approx(roof)
    for op, gbs in row["weight_gb_s"].items():
        assert gbs == pytest.approx(row["weight_mb"][op] / 1e3 / (row["ops"][op] / 1e3))
    print_profile([row], "smollm2")
    out = capsys.readouterr().out
    assert "roofline" in out and "GB/s while reading them" in out and "mul_mat" in out
