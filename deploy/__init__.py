"""Deployment: the local launcher (embedded Redis, local Ray) and cluster configs."""
