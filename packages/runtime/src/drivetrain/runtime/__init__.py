"""drivetrain-runtime: what rollouts, engines and the trainer share beyond the contracts
(``drivetrain.api``), standard library only. See the package README."""
