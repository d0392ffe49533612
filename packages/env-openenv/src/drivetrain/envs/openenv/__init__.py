"""OpenEnv servers as a drivetrain environment (``env=openenv``)."""
