"""Grafana provisioning and the miniTE dashboard; `panels` reads the dashboard's queries."""
