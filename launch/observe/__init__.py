"""What a run shows: the banner and DDP lines (``banner``), the step lines, summary and
``metrics.json`` (``report``), TensorBoard (``tensorboard``), the profiler
(``profile``), the overlap timeline (``timeline``), and the observer that drives them
from the loop (``observer``)."""
