"""The contract: what calibration and the deployed guard must agree on for the calibration
scores to be exchangeable with live ones, and what a chat model and the guard exchange.

* :mod:`.deployment` — :class:`~.deployment.DeploymentRecord`: the settings calibration used
  (model, prompts, budgets, decoding, decode path, tools, stream rule), recorded in the
  artifact, and the checks the guard runs on every call;
* :mod:`.prompts` — how a question becomes chat messages (one function for calibration and
  run time);
* :mod:`.tool_choice` — the one reading of ``tool_choice``;
* :mod:`.chat_model_specs` — an API chat model's spec, identity and fingerprint;
* :mod:`.kernels` — the kernel facts that decide a score's last bits, and the tolerance when
  they differ;
* :mod:`.metadata` — :class:`~.metadata.ResponseMetadata`: the response fields a chat model
  writes and the scorers read;
* :mod:`.streaming` — a certified stream's chunk rule and statistic, and the channel an
  engine hands the guard its prefixes on;
* :mod:`.runnables` — where the chat models are inside a runnable.

The engines (``abstain_guard.adapters``, ``abstain_guard.backends``) write to it, the scorers
read it, the guard checks it.

May import: ``abstain_guard.guarantee``, ``abstain_guard.errors``.
"""
