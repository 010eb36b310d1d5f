"""The `make` fixture: the loader tests in this folder that take it run once per backend."""

import pytest
from loader_cases import loader_class

BACKENDS = ["dali", "torch"]


@pytest.fixture(params=BACKENDS)
def make(request):
    """``make(reader, batch_size, **kw)``: a loader of this run's backend on the CPU at 16 px, in this process."""
    cls = loader_class(request.param)

    def factory(reader, batch_size, **kw):
        kw.setdefault("image_size", 16)
        kw.setdefault("device", "cpu")
        kw.setdefault("num_threads", 2)
        if cls.__name__ == "TorchIterator":
            kw.setdefault("num_workers", 0)
        return cls(reader, batch_size, **kw)

    factory.backend = request.param
    return factory
