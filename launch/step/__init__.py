"""One training step: the step runner with its warm-up (``train_step``), the optimizer
step (``optim``), the learning-rate schedule (``schedule``) and held-out evaluation
(``evaluate``)."""
