"""Planning and cost: which graph node goes to which gradient bucket
(``buckets``), the cost model's measurements (``cost``), the dynamic program that
chooses bucket boundaries from cost tables (``solver``), the cost-model plan of a
captured graph (``auto``) and its calibration from a measured backward
(``calibrate``). Pure planning: nothing here wraps, splits or compiles a model, and
nothing imports the strategies, alignment or compression packages. The public names
are re-exported by ``ddp_opt``; import the building blocks from their modules."""

__all__ = ["auto", "buckets", "calibrate", "cost", "solver"]
