"""meshlift's conformance kit against this backend: the whole suite, collected here."""

from meshlift.testing import TestConformance  # noqa: F401

pytest_plugins = ["meshlift.testing"]
meshlift_backends = ["pmap"]
