"""Extraction on Ray Data (``pip install 'constrained_spec[ray]'``): ``extract_dataset(ds, schema)``
maps a dataset through actors that each run the batch engine; ``extract_to`` goes from files to
an output folder with resume. See ``constrained_spec.pipelines.distributed``."""

from .pipelines.distributed import COLUMNS, extract_dataset, extract_to, read_input

__all__ = ["COLUMNS", "extract_dataset", "extract_to", "read_input"]
