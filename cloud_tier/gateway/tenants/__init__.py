"""Tenants: API keys, quotas, budgets, fair shares and priority classes."""
