"""meshlift's conformance kit (meshlift.testing) against the pipeline backend only."""

from meshlift.testing import TestConformance  # noqa: F401  (the suite, collected here)

pytest_plugins = ["meshlift.testing"]
meshlift_backends = ["pipeline"]
