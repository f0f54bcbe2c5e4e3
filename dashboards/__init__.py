"""witcert.dashboards"""
