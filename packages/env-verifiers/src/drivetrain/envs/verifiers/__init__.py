"""verifiers environments (Prime Intellect's environments hub) as a drivetrain environment
(``env=verifiers``), served by the hub's own server in the hub's own Python."""
