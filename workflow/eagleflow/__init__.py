"""eagleflow: the logic behind the Snakemake rules (rules stay thin and call this)."""

__version__ = "0.1.0"
