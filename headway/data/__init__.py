"""headway.data"""
