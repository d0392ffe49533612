"""reasoning-gym as a drivetrain environment (``env=reasoning_gym``)."""
