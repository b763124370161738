"""`wllm pull REPO[:FILE]` and `wllm serve REPO[:FILE]` with GGUF repositories, the hub mocked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError

from wllm.cli import main
from wllm.model.loader.errors import ModelLoadError
from wllm.model.loader.hf_source import parse_hub_ref, resolve_source, select_gguf

FILES = [
    "README.md",
    "Qwen-0.5B-Q4_K_M.gguf",
    "Qwen-0.5B-Q8_0.gguf",
    "big/Qwen-0.5B-F16-00001-of-00002.gguf",
    "big/Qwen-0.5B-F16-00002-of-00002.gguf",
]


class FakeHub:
    """list_repo_files / hf_hub_download / snapshot_download of one GGUF repo, into a folder."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.root, self.files, self.downloads = root, files, []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hub = self

        class Api:
            def list_repo_files(self, repo_id: str, revision: Any = None) -> list[str]:
                hub.check(repo_id)
                return list(hub.files)

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def check(self, repo_id: str) -> None:
        if repo_id != "org/qwen-gguf":
            response = httpx.Response(404, request=httpx.Request("GET", f"https://huggingface.co/{repo_id}"))
            raise RepositoryNotFoundError(f"{repo_id} not found", response=response)

    def hf_hub_download(self, repo_id: str, filename: str, revision: Any = None, local_files_only: bool = False) -> str:
        self.check(repo_id)
        if filename not in self.files:
            raise AssertionError(f"{filename} was never listed")
        self.downloads.append(filename)
        path = self.root / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")
        return str(path)

    def snapshot_download(
        self, repo_id: str, revision: Any = None, allow_patterns: Any = None, local_files_only: bool = False
    ) -> str:
        self.check(repo_id)
        folder = self.root / "snapshot"
        folder.mkdir(exist_ok=True)
        return str(folder)  # the json files only: no config.json in a GGUF repo


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    fake = FakeHub(tmp_path, FILES)
    fake.install(monkeypatch)
    return fake


def test_refs() -> None:
    assert parse_hub_ref("org/name") == ("org/name", None)
    assert parse_hub_ref("org/name:Q8_0") == ("org/name", "Q8_0")
    assert parse_hub_ref("org/name:sub/x.gguf") == ("org/name", "sub/x.gguf")
    assert parse_hub_ref("model.gguf") is None and parse_hub_ref("org/name:") is None
    assert parse_hub_ref(r"C:\models\x.gguf") is None


def test_selection() -> None:
    assert select_gguf("r", FILES, None) == ["Qwen-0.5B-Q4_K_M.gguf"]  # Ollama's default quantization
    assert select_gguf("r", FILES, "q8_0") == ["Qwen-0.5B-Q8_0.gguf"]
    assert select_gguf("r", FILES, "F16") == [
        "big/Qwen-0.5B-F16-00001-of-00002.gguf",
        "big/Qwen-0.5B-F16-00002-of-00002.gguf",
    ]
    assert select_gguf("r", FILES, "Qwen-0.5B-Q8_0.gguf") == ["Qwen-0.5B-Q8_0.gguf"]
    assert select_gguf("r", ["only.gguf"], None) == ["only.gguf"]
    with pytest.raises(ModelLoadError, match="no GGUF file matching 'IQ2'.*from: .*Qwen-0.5B-F16-00001-of-00002.gguf"):
        select_gguf("r", FILES, "IQ2")
    with pytest.raises(ModelLoadError, match="no file 'nope.gguf' in the repository"):
        select_gguf("r", FILES, "nope.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files match 'qwen'"):
        select_gguf("r", FILES, "Qwen")
    with pytest.raises(ModelLoadError, match="several GGUF files and none is Q4_K_M"):
        select_gguf("r", ["a-Q8_0.gguf", "a-F16.gguf"], None)
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf file"):
        select_gguf("r", ["README.md"], None)


def test_pull_downloads_the_gguf_and_serve_resolves_the_same_file(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["pull", "org/qwen-gguf"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == hub.root / "Qwen-0.5B-Q4_K_M.gguf" and hub.downloads == ["Qwen-0.5B-Q4_K_M.gguf"]
    assert main(["pull", "org/qwen-gguf:F16"]) == 0
    assert hub.downloads[1:] == ["big/Qwen-0.5B-F16-00001-of-00002.gguf", "big/Qwen-0.5B-F16-00002-of-00002.gguf"]
    # What `wllm serve org/qwen-gguf:Q8_0` loads: the loader resolves the same reference.
    resolved = resolve_source("org/qwen-gguf:Q8_0")
    assert (resolved.kind, resolved.path.name, resolved.origin) == ("gguf", "Qwen-0.5B-Q8_0.gguf", "hub")


def test_unknown_repo_and_file_are_clear_errors(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "org/missing"]) == 1
    assert "org/missing: no such model on the Hugging Face Hub" in capsys.readouterr().err
    assert main(["pull", "org/qwen-gguf:Q3_K_S"]) == 1
    err = capsys.readouterr().err
    assert "no GGUF file matching 'Q3_K_S'" in err and "Qwen-0.5B-Q8_0.gguf" in err and "Traceback" not in err
    assert main(["pull", "not-a-repo"]) == 2
    assert "not a hub repository" in capsys.readouterr().err


def test_offline_uses_only_the_cache(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (hub.root / "snapshot" / "cached-Q4_K_M.gguf").parent.mkdir(parents=True, exist_ok=True)
    (hub.root / "snapshot" / "cached-Q4_K_M.gguf").write_bytes(b"GGUF")
    hub.files = ["cached-Q4_K_M.gguf"]
    assert resolve_source("org/qwen-gguf").path.name == "cached-Q4_K_M.gguf"
