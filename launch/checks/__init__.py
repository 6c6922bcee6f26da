"""Checks of a run: the validation pass before any process group starts (``validate``
and its ``rules``, ``rules_resources``, ``rules_train``, ``probe``), the ranks'
agreement on the config (``agree``), and the doctor's report (``diagnosis``)."""
