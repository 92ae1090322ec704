"""The identity of the model a vLLM server serves: one sha256 over its weights, config,
generation config, tokenizer and chat template, for a local folder, a weights file (GGUF) and
a Hugging Face hub snapshot alike (and of a LoRA adapter: its weights and adapter config).

A hub id (``vllm serve org/model``) is resolved offline to the snapshot folder vLLM loaded
(``huggingface_hub``'s cache, the server's ``--revision``); an identity that cannot be read
there — no snapshot, no weight files — is refused (:class:`IdentityUnverifiable`), never
recorded as unknown. Each file's sha256 is:

- for a file of the hub's cache, the name of the blob it links to when that name is a sha256
  (the hub stores large files content-addressed: the name *is* the content's digest);
- otherwise the file's bytes, hashed once and kept in a persistent cache (``$ABSTAIN_GUARD_
  DIGEST_CACHE``, default ``~/.cache/abstain_guard/digests``: mount it on a volume in a
  container) keyed by the file's device, inode, size, modification and change times — a
  file rewritten or replaced gets another inode or change time, which no user-level call sets
  back, so a stale digest is never read for new bytes.

hashlib only (the guard's client imports it without torch or vLLM). ``python -m
abstain_guard.backends.vllm_identity MODEL`` prints the identity (and fills the cache, e.g.
when a deployment image is built).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from abstain_guard.errors import BackendError

#: Where file digests are kept between starts.
DIGEST_CACHE_ENV = "ABSTAIN_GUARD_DIGEST_CACHE"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: The files besides the weights that decide what a prompt becomes and how it is generated.
IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "adapter_config.json",
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class IdentityUnverifiable(BackendError):
    """The served model's identity cannot be read from files (refused, not passed)."""


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "abstain_guard"
    return Path(os.environ.get(DIGEST_CACHE_ENV, default / "digests"))


def _hash_bytes(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of the file ``path`` (a hub blob's own name when it is one; else the bytes,
    cached by device, inode, size, mtime and ctime)."""
    real = path.resolve()
    if real.parent.name == "blobs" and _SHA256.fullmatch(real.name) and path.is_symlink():
        return real.name
    st = real.stat()
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    cached = _cache_dir() / hashlib.sha256(f"{real}\0{stamp}".encode()).hexdigest()
    try:
        value = cached.read_text(encoding="ascii").strip()
        if _SHA256.fullmatch(value):
            return value
    except OSError:
        pass
    value = _hash_bytes(real)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(value, encoding="ascii")
    except OSError:
        pass
    return value


def resolve_model_folder(
    model: str | os.PathLike[str], revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """The folder vLLM loads ``model`` from: a local folder as given, a hub id its snapshot
    in the local cache (``cache_dir``: vLLM's ``--download-dir``, default the hub's; offline:
    nothing is downloaded).

    Raises:
        IdentityUnverifiable: neither a folder nor a cached snapshot.
    """
    folder = Path(model)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id=str(model), revision=revision, cache_dir=cache_dir, local_files_only=True
            )
        )
    except Exception as exc:  # not installed, not a repo id, not in the cache
        raise IdentityUnverifiable(
            f"abstain_guard: the served model {str(model)!r} (revision {revision!r}) is neither "
            f"a local folder nor a snapshot in the Hugging Face cache ({exc}); its identity "
            "cannot be verified, so the guard's connector refuses to serve it."
        ) from exc


def _listing(folders: Iterable[tuple[str, Path]], weights: bool) -> list[tuple[str, Path]]:
    files: dict[str, Path] = {}
    for role, folder in folders:
        for path in sorted(folder.iterdir()):
            if not path.is_file():
                continue
            if path.name in IDENTITY_FILES or (weights and path.suffix in WEIGHT_SUFFIXES):
                files.setdefault(f"{role}/{path.name}", path)
    return sorted(files.items())


def model_identity(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    tokenizer_revision: str | None = None,
    dummy_weights: bool = False,
    cache_dir: str | None = None,
) -> str:
    """sha256 over the served model's files — weights (``dummy_weights``: vLLM's
    ``--load-format dummy``, random weights, recorded as such), config, generation config,
    tokenizer and chat template — each named by its role and name, with its size and sha256.
    ``model`` is a folder, a hub id, or one weights file (a GGUF vLLM loads as given, its
    tokenizer from ``tokenizer``).

    Raises:
        IdentityUnverifiable: the folder or snapshot is missing, or holds no weight files.
    """
    single = Path(model)
    files = [(f"model/{single.name}", single)] if single.is_file() else []
    folders = [] if files else [("model", resolve_model_folder(model, revision, cache_dir))]
    if tokenizer is not None and str(tokenizer) != str(model):
        folders.append(
            ("tokenizer", resolve_model_folder(tokenizer, tokenizer_revision, cache_dir))
        )
    files = sorted(files + _listing(folders, weights=not dummy_weights))
    if not dummy_weights and not any(p.suffix in WEIGHT_SUFFIXES for _, p in files):
        raise IdentityUnverifiable(
            f"abstain_guard: {model} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}); "
            "the served model's identity cannot be verified."
        )
    digest = hashlib.sha256(b"dummy-weights\n" if dummy_weights else b"")
    for name, path in files:
        digest.update(f"{name}\0{path.stat().st_size}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m abstain_guard.backends.vllm_identity MODEL [REVISION]")
        return 2
    revision = args[1] if len(args) > 1 else None
    identity = model_identity(args[0], revision=revision)
    print(json.dumps({"model": args[0], "model_sha256": identity}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
