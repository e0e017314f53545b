"""Record llama.cpp on a tiny llama quantized by llama.cpp's own quantizer to the weight types the
Hub ships (CI never runs llama.cpp):
    python tests/parity/record_quant_types.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
writes tests/data/quant/<TYPE>.gguf (the quantized files, tens of kB) and tests/data/quant_parity.json:
per type, greedy steps and top-5 log-probs under llama.cpp's defaults, and the same steps' top-1
log-probs under its variants (flash attention on and off, f16 and f32 K/V), whose spread sets the
tolerance of tests/test_quant_parity.py. IQ3_XXS, IQ2_XXS/XS/S and IQ1_S/M are left out: llama.cpp refuses
to make them without an importance matrix (their dequantization is checked against gguf.quants), and
MXFP4, which llama.cpp's quantizer gives experts only (tests/test_arch_parity.py runs gpt-oss's).
llama.cpp must be built without AMX on hosts that have it (-DGGML_NATIVE=OFF and the AVX-512 flags):
its AMX matmul crashed in this sandbox."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from models import N_STEPS, PROMPTS, write  # noqa: E402

DATA = Path(__file__).parent.parent / "data"
TYPES = ["IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0", "Q4_K_M"]
# a llama whose rows are whole 256-weight super-blocks
SHAPE = {"embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
         "attention.head_count_kv": 2, "attention.key_length": 64, "attention.value_length": 64,
         "rope.dimension_count": 64}
CODE = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
jobs = json.loads(sys.argv[1])

def steps(path, prompt, n_steps, **kw):
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, logits_all=True, verbose=False, **kw)
    ids, out = [], []
    llm.eval(prompt)
    for _ in range(n_steps):
        lg = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        lp = lg - lg.max(); lp -= np.log(np.exp(lp).sum())
        top = np.argsort(-lp, kind="stable")[:5]
        out.append({"top_ids": [int(t) for t in top], "top_logprobs": [round(float(lp[t]), 5) for t in top]})
        ids.append(int(top[0]))
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), int(top[0])):
            break
        llm.eval([int(top[0])])
    return ids, out

res = {}
for name, (src, dst, ftype) in jobs["files"].items():
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) != 0:
        raise SystemExit(f"quantizing to {name} failed")
    cases = []
    for prompt in jobs["prompts"]:
        ids, st = steps(dst, prompt, jobs["n_steps"])
        variants = {}
        for vname, kw in {"fa_on": dict(flash_attn=True), "fa_off": dict(flash_attn=False),
                          "kv_f32": dict(type_k=0, type_v=0)}.items():
            vids, vst = steps(dst, prompt, jobs["n_steps"], **kw)
            variants[vname] = {"greedy_ids": vids, "top1_logprobs": [s["top_logprobs"][0] for s in vst]}
        cases.append({"prompt_ids": prompt, "greedy_ids": ids, "steps": st, "variants": variants})
    res[name] = cases
print(json.dumps(res))
"""

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    a = ap.parse_args()
    (DATA / "quant").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        src = str(write(Path(d) / "f32.gguf", ("llama", SHAPE, {})))
        ftypes = subprocess.run([a.llama_python, "-c", "import llama_cpp, json, sys; print(json.dumps("
                                 "{t: getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + t) for t in sys.argv[1:]}))", *TYPES],
                                capture_output=True, text=True, check=True)
        out = {}
        for t, f in json.loads(ftypes.stdout).items():  # a process each: llama.cpp may crash on one
            dst = DATA / "quant" / f"{t}.gguf"
            job = {"files": {t: (src, str(dst), f)}, "prompts": PROMPTS, "n_steps": N_STEPS}
            res = subprocess.run([a.llama_python, "-c", CODE, json.dumps(job)], capture_output=True, text=True)
            if res.returncode:
                print(f"{t}: llama.cpp failed (exit {res.returncode}); left out", file=sys.stderr)
                dst.unlink(missing_ok=True)
                continue
            out.update(json.loads(res.stdout))
    (DATA / "quant_parity.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {DATA / 'quant_parity.json'} and {len(out)} files under {DATA / 'quant'}")
