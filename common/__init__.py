"""Stdlib-only helpers every pdserve package may import: flags (dataclass -> argparse), env (every PDSERVE_* variable), net (loopback / bind check), logs (logging set-up)."""
