import os

from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(session, config, items):
    """``PYTEST_REVERSE=1`` runs the collected tests in reverse order (an order-independence check; random order:
    ``-p randomly``)."""
    if os.environ.get("PYTEST_REVERSE") == "1":
        items.reverse()
