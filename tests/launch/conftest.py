import os
import shutil

import pytest
from slurm_cluster import SlurmCluster, install, missing_programs


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """One Slurm cluster for the test session, installed first when needed (CI runs as root)."""
    if missing_programs() and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing_programs())} missing) and cannot be: needs root and apt-get"
        )
    install()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
