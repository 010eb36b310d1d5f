"""Loaders: the epoch driver every backend shares (`base.LoaderBase`), the backends, and `factory.make_loader`."""
