"""headway.decode"""
