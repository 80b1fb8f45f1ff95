"""`python -m kvmesh.deployments.cli`: the same entry point as the `kvmesh` console script."""

import sys

from kvmesh.deployments.cli import main

sys.exit(main())
