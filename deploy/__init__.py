"""Deployment files of miniTE (Dockerfile, compose, Prometheus, Grafana); a package only so that tests can
import `deploy.grafana.panels` from the repository root."""
