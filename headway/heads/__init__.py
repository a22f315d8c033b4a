"""headway.heads"""
