"""Where a job's processes meet: torch's init_method and rank 0's store, decided once by the plan
(``settings.plan``) from --dist-url or the launcher's MASTER_ADDR/PORT; ``launching.process_group``
joins there. Pure: the environment is read, never written."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from imagenet.errors import UsageError
from imagenet.settings.flags import Config
from imagenet.settings.launch import Launch
from imagenet.settings.slurm import first_slurm_host, is_slurm_job_step


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where a job's processes meet: torch's init_method, and rank 0's store."""

    init_method: str  # --dist-url as given, or env:// (MASTER_ADDR/PORT)
    host: str = ""  # rank 0's store ("" and None: none known, as with a file:// --dist-url)
    port: int | None = None

    def variables(self) -> dict[str, str]:
        """MASTER_ADDR/PORT as torch's env:// reads them: what mp.spawn's children are given."""
        if self.init_method != "env://" or self.port is None:
            return {}
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port)}


def rendezvous(cfg: Config, launch: Launch, env: Mapping[str, str],
               creates_group: bool = True) -> Rendezvous:
    """Where the processes meet: --dist-url, or (env://) the launcher's MASTER_ADDR/PORT, rank 0's
    node and a port from the job id under srun, a free loopback port for a one-node mp.spawn.

    ``creates_group``: False where no process group is created here (one process, or the
    caller's group): then only what the launcher said, nothing derived, and no error.
    """
    if cfg.dist_url != "env://":
        url = urlparse(cfg.dist_url)  # checked by the flags (settings.flags.check_dist_url)
        if url.scheme == "tcp":
            return Rendezvous(cfg.dist_url, url.hostname or "", url.port)
        return Rendezvous(cfg.dist_url)
    given = {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in env}
    if creates_group and launch.mode in ("env", "spawn") and is_slurm_job_step(env) \
            and "RANK" not in env:
        # The step's nodes: an srun inside a larger allocation may not start on its first node.
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        given.setdefault("MASTER_ADDR", first_slurm_host(nodes))
        # Every task must agree on the port without talking: derive it from the job id.
        given.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if creates_group and len(given) < 2:
        if launch.mode == "spawn" and launch.nnodes == 1:
            # Single-node fallback: rank 0 is this machine; pick a free loopback port.
            given.setdefault("MASTER_ADDR", "127.0.0.1")
            given.setdefault("MASTER_PORT", str(free_port()))
        else:
            raise UsageError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT for a "
                             "multi-node or manual run; give --dist-url tcp://HOST:PORT of "
                             "rank 0 or export both variables")
    port = given.get("MASTER_PORT", "")
    valid = port.isdigit() and 0 < int(port) < 65536
    if creates_group and not valid:
        raise UsageError(f"MASTER_PORT={port} is not a port: give a number from 1 to 65535")
    return Rendezvous("env://", given.get("MASTER_ADDR", ""), int(port) if valid else None)
